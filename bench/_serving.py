"""Shared by the serving benchmarks: start `deepinfer serve` on a free port, wait for it, read /metrics."""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

# ---- server ---------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deepinfer_argv() -> list[str]:
    script = Path(sys.executable).parent / "deepinfer"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from deepinfer_core.cli import main; sys.exit(main())"]


class LocalServer:
    """`deepinfer serve` in a subprocess (its own session, so a Ctrl-C here reaches it only through stop())."""

    def __init__(self, server_args: list[str], threads: int, log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [*deepinfer_argv(), "serve", "--host", "127.0.0.1", "--port", str(self.port), *server_args]
        self.command = shlex.join(["deepinfer", "serve", "--host", "127.0.0.1", "--port", str(self.port), *server_args])
        self.env = dict(os.environ)
        if threads:
            self.env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        self.threads = threads
        self.log_path = log_dir / "server.log"
        self.proc: subprocess.Popen | None = None
        self.started_at = None

    def start(self) -> None:
        self.started_at = time.perf_counter()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )

    def log_lines(self) -> list[str]:
        try:
            return self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []

    def cpu_seconds(self) -> float | None:
        """utime + stime of the server process (all its threads), from /proc; None where unavailable."""
        if self.proc is None:
            return None
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return None

    def stop(self, grace: float) -> dict:
        if self.proc is None:
            return {}
        if self.proc.poll() is not None:
            return {"returncode": self.proc.returncode, "stop_seconds": 0.0, "signal": None, "already_exited": True}
        t0 = time.perf_counter()
        self.proc.send_signal(signal.SIGTERM)
        sent = "SIGTERM"
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            sent = "SIGTERM, then SIGKILL after the grace period"
            self.proc.wait()
        return {"returncode": self.proc.returncode, "stop_seconds": time.perf_counter() - t0, "signal": sent}


async def wait_healthy(client: httpx.AsyncClient, url: str, server: LocalServer | None, timeout: float) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if server is not None and server.proc.poll() is not None:
            tail = "\n".join(server.log_lines()[-30:])
            raise SystemExit(f"the server exited with code {server.proc.returncode} before it was healthy:\n{tail}")
        try:
            if (await client.get(url + "/health", timeout=5)).status_code == 200:
                return time.perf_counter() - t0
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.25)
    raise SystemExit(f"{url}/health did not answer 200 within {timeout:.0f} s")


# ---- metrics --------------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?)\s+(\S+)")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format -> {'name{labels}': value}; bucket and _created samples dropped."""
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or "_bucket{" in line:
            continue
        if (m := _SAMPLE.match(line)) and not m.group(1).split("{")[0].endswith("_created"):
            try:
                out[m.group(1)] = float(m.group(2))
            except ValueError:
                pass
    return out


async def scrape(client: httpx.AsyncClient, url: str) -> dict[str, float] | None:
    try:
        response = await client.get(url + "/metrics", timeout=30)
        return parse_metrics(response.text) if response.status_code == 200 else None
    except httpx.HTTPError:
        return None


def metrics_delta(before: dict | None, after: dict | None) -> dict | None:
    """What the server counted during a level: counter and histogram deltas, gauges before -> after."""
    if not before or not after:
        return None

    def d(name: str) -> float | None:
        return after[name] - before[name] if name in after and name in before else None

    def g(name: str) -> list[float | None]:
        return [before.get(name), after.get(name)]

    ttft_n, tbt_n = d("deepinfer_time_to_first_token_seconds_count"), d("deepinfer_time_between_tokens_seconds_count")
    statuses = {
        k.split('status="')[1].split('"')[0]: after[k] - before.get(k, 0.0)
        for k in after
        if k.startswith('deepinfer_requests_total{endpoint="chat_completions"') and after[k] - before.get(k, 0.0)
    }
    return {
        "chat_completions_by_status": statuses,
        "prompt_tokens": d("deepinfer_prompt_tokens_total"),
        "generation_tokens": d("deepinfer_generation_tokens_total"),
        "ttft_observations": ttft_n,
        "ttft_mean_s": d("deepinfer_time_to_first_token_seconds_sum") / ttft_n if ttft_n else None,
        "tbt_observations": tbt_n,
        "tbt_mean_s": d("deepinfer_time_between_tokens_seconds_sum") / tbt_n if tbt_n else None,
        "prefix_cache_hit_rate_cumulative_before_after": g("deepinfer_prefix_cache_hit_rate"),
        "kv_blocks_used_before_after": g("deepinfer_kv_blocks_used"),
        "kv_blocks_total": after.get("deepinfer_kv_blocks_total"),
        "requests_running_before_after": g("deepinfer_requests_running"),
        "requests_waiting_before_after": g("deepinfer_requests_waiting"),
    }


async def sample_metrics(client: httpx.AsyncClient, url: str, interval: float, samples: list, stop: asyncio.Event):
    """Gauges while a level runs (they are refreshed only when /metrics is scraped)."""
    while not stop.is_set():
        t = time.perf_counter()
        if (m := await scrape(client, url)) is not None:
            samples.append(
                (
                    m.get("deepinfer_kv_blocks_used"),
                    m.get("deepinfer_requests_running"),
                    m.get("deepinfer_requests_waiting"),
                )
            )
        try:
            await asyncio.wait_for(stop.wait(), timeout=max(0.0, interval - (time.perf_counter() - t)))
        except asyncio.TimeoutError:
            pass


def gauge_summary(samples: list) -> dict:
    out = {"samples": len(samples)}
    for i, name in enumerate(("kv_blocks_used", "requests_running", "requests_waiting")):
        values = [s[i] for s in samples if s[i] is not None]
        out[f"{name}_max"] = max(values) if values else None
        out[f"{name}_mean"] = sum(values) / len(values) if values else None
    return out
