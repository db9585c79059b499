"""Live `deepinfer serve` processes for the HTTP tests: real subprocesses of the installed console script on
free ports of 127.0.0.1, on the embedded demo model (random weights, the DeepSeek-V4 tokenizer).

Each server runs with one torch thread: on a 2-core machine the test client and up to three servers share
the cores, and oversubscribed OpenMP threads make small CPU kernels orders of magnitude slower.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

MODEL = "deepinfer-demo-deepseek-v4-random"
API_KEY = "secret"
COMMON_ARGS = ["--accelerator", "cpu", "--max-model-len", "2048"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deepinfer_exe() -> str:
    exe = shutil.which("deepinfer", path=str(Path(sys.executable).parent))
    assert exe, "the deepinfer console script is not installed next to this Python"
    return exe


@dataclass
class Server:
    """One `deepinfer serve` subprocess."""

    args: list[str]
    log_path: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None
    max_open_files: int | None = None  # an open-file limit the process cannot raise

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Server:
        env = {k: v for k, v in os.environ.items() if k not in ("DEEPINFER_ACCELERATOR", "DEEPINFER_API_KEY")}
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        command = [deepinfer_exe(), "serve", "--port", str(self.port), *COMMON_ARGS, *self.args]
        files = self.max_open_files

        def limit_files() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))

        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=None if files is None else limit_files,
            )
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_ready(self, timeout: float = 90.0) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"deepinfer serve exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.stop()
        pytest.fail(f"deepinfer serve did not answer /health within {timeout} s:\n{self.log()}")

    def stop(self) -> None:
        self.begin_stop()
        self.wait_stopped()

    def begin_stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def wait_stopped(self) -> None:
        if self.process is None:
            return
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=15)

    def metrics(self) -> dict[str, float]:
        """The /metrics samples, keyed by their full name with labels (`name{a="b"}`)."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                samples[name] = float(value)
        return samples

    def value(self, name: str, samples: dict[str, float] | None = None) -> float:
        """The sum of a metric's samples over all label values (`vllm:generation_tokens_total`)."""
        samples = self.metrics() if samples is None else samples
        return sum(v for key, v in samples.items() if key == name or key.startswith(name + "{"))

    def gauges(self) -> tuple[float, float, float]:
        """(kv blocks used, requests running, requests waiting)."""
        m = self.metrics()
        running, waiting = self.value("vllm:num_requests_running", m), self.value("vllm:num_requests_waiting", m)
        return m["deepinfer_kv_blocks_used"], running, waiting

    def wait_idle(self, timeout: float = 10.0) -> tuple[float, float, float]:
        """Poll /metrics until no KV block is used and nothing runs or waits; -> the last gauges."""
        deadline = time.monotonic() + timeout
        while True:
            gauges = self.gauges()
            if gauges == (0, 0, 0) or time.monotonic() > deadline:
                return gauges
            time.sleep(0.05)

    def server_errors(self) -> dict[str, float]:
        """deepinfer_requests_total samples with a 5xx status other than the 503 of backpressure."""
        return {
            name: value
            for name, value in self.metrics().items()
            if name.startswith("deepinfer_requests_total") and re.search(r'status="5(?!03)\d\d"', name) and value
        }

    def assert_no_tracebacks(self) -> None:
        log = self.log()
        assert "Traceback" not in log and "unexpected error" not in log, log[-4000:]


@pytest.fixture(scope="session")
def start_server(tmp_path_factory):
    """start_server(*args) -> a started, ready Server; every server is stopped at the end of the session."""
    started: list[Server] = []

    def start(*args: str, wait: bool = True) -> Server:
        log_path = tmp_path_factory.mktemp("serve") / "server.log"
        server = Server(list(args), log_path).start()
        started.append(server)
        return server.wait_ready() if wait else server

    yield start
    for server in started:  # all signalled first: they shut down together (one by one took ~8 s)
        server.begin_stop()
    for server in started:
        server.wait_stopped()


@pytest.fixture(scope="session")
def server(start_server) -> Server:
    """The main server: open access, a small KV cache and a 1 MiB body limit."""
    return start_server(
        "--num-kv-blocks", "64", "--max-num-seqs", "64", "--max-num-batched-tokens", "2048",
        "--max-request-body-mb", "1",
    )  # fmt: skip


@pytest.fixture(scope="session")
def auth_server(start_server) -> Server:
    return start_server("--num-kv-blocks", "16", "--api-key", API_KEY)


@pytest.fixture(scope="session")
def busy_server(start_server) -> Server:
    """One running request and one waiting at most; beyond, 503 + Retry-After. 4 KV blocks (512 tokens)."""
    return start_server("--num-kv-blocks", "4", "--max-num-seqs", "1", "--max-waiting-requests", "1")


@pytest.fixture(scope="session")
def openai_client(server):
    import openai

    client = openai.OpenAI(
        base_url=server.url + "/v1",
        api_key="unused",
        max_retries=0,
        default_headers={"Connection": "close"},
        timeout=60,
    )
    yield client
    client.close()


@pytest.fixture(scope="session")
def anthropic_client(server):
    import anthropic

    client = anthropic.Anthropic(
        base_url=server.url, api_key="unused", max_retries=0, default_headers={"Connection": "close"}, timeout=60
    )
    yield client
    client.close()


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60, headers={"Connection": "close"}) as client:
        yield client


@pytest.fixture(scope="session")
def recipe():
    """The server's prompt encoding, built in-process exactly as `deepinfer serve` builds it."""
    from deepinfer_core.engine.tokenizer import demo_tokenizer_dir
    from deepinfer_core.serve.state import build_recipe

    return build_recipe(str(demo_tokenizer_dir() / "tokenizer.json"), MODEL)
