"""Hugging Face Hub ids for `LLM(model=...)`: loaded from the Hub cache (offline mode included), and every way a
download can fail is one clear DeepInferError. No test reaches the network: the Hub is a local stub or a closed port."""

from __future__ import annotations

import http.server
import shutil
import threading

import pytest

from deepinfer import LLM, DeepInferError, SamplingParams
from deepinfer_core.engine.tokenizer import demo_tokenizer_dir

COMMIT = "0123456789abcdef0123456789abcdef01234567"
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
CLOSED_PORT = "http://127.0.0.1:9"


def fake_cache(root, repo_id: str, source) -> None:
    """The Hub cache layout: models--org--name/refs/main -> commit, snapshots/<commit>/ holding the files."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.copytree(source, repo / "snapshots" / COMMIT)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An empty Hub cache named by HF_HUB_CACHE, offline unless a test says otherwise."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # as if the variable was unset at import
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    return cache


def load(model, **kwargs) -> LLM:
    return LLM(model=model, accelerator="cpu", block_size=16, num_kv_blocks=16, progress=False, **kwargs)


def tokens(llm: LLM) -> tuple[int, ...]:
    return llm.generate([5, 6, 7], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_a_hub_id_in_the_cache_loads_offline(hub, tiny_checkpoint):
    fake_cache(hub, "tiny-org/tiny-v3", tiny_checkpoint)
    llm = load("tiny-org/tiny-v3")
    assert llm.model_name == "tiny-org/tiny-v3"
    assert tokens(llm) == tokens(load(tiny_checkpoint))


def test_download_dir_names_the_cache(hub, tmp_path, tiny_checkpoint, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    fake_cache(elsewhere, "tiny-org/tiny-v3", tiny_checkpoint)
    assert tokens(load("tiny-org/tiny-v3", download_dir=elsewhere)) == tokens(load(tiny_checkpoint))
    with pytest.raises(DeepInferError, match="not in .*hub"):  # the default cache does not have it
        load("tiny-org/tiny-v3")


def test_a_tokenizer_hub_id_in_the_cache(hub, tiny_checkpoint):
    folder = hub.parent / "tok"
    folder.mkdir()
    shutil.copy(demo_tokenizer_dir() / "tokenizer.json", folder)
    fake_cache(hub, "tok-org/tok", folder)
    llm = load(tiny_checkpoint, tokenizer="tok-org/tok")
    assert llm.get_tokenizer().decode(llm.get_tokenizer().encode("Hello there")) == "Hello there"


def test_offline_and_not_cached_says_how_to_download(hub):
    with pytest.raises(DeepInferError) as err:
        load("tiny-org/missing", revision="v1")
    message = str(err.value)
    assert "HF_HUB_OFFLINE is set and model tiny-org/missing at revision v1 is not in" in message
    assert "`hf download tiny-org/missing --revision v1`" in message and str(hub) in message


def test_no_network_is_one_clear_error(hub, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", CLOSED_PORT)
    with pytest.raises(DeepInferError) as err:
        load("tiny-org/missing")
    message = str(err.value)
    assert message.startswith(f"could not download model tiny-org/missing from the Hugging Face Hub ({CLOSED_PORT})")
    assert "ConnectError" in message and "Check the network" in message and "Traceback" not in message


def test_no_network_falls_back_to_the_cache(hub, tiny_checkpoint, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", CLOSED_PORT)
    fake_cache(hub, "tiny-org/tiny-v3", tiny_checkpoint)
    assert load("tiny-org/tiny-v3").model_name == "tiny-org/tiny-v3"


class _StubHub(http.server.BaseHTTPRequestHandler):
    """Answers every request as the Hub answers for a missing or a gated repository."""

    def do_GET(self):  # noqa: N802
        missing = "missing" in self.path
        self.send_response(404 if missing else 403)
        self.send_header("X-Error-Code", "RepoNotFound" if missing else "GatedRepo")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


@pytest.fixture
def stub_hub(hub, monkeypatch):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _StubHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    yield
    server.shutdown()
    server.server_close()


def test_a_repo_the_hub_does_not_have(stub_hub):
    with pytest.raises(DeepInferError, match="model tiny-org/missing is neither a local folder nor a repository"):
        load("tiny-org/missing")


def test_a_gated_repo_says_how_to_get_access(stub_hub):
    with pytest.raises(DeepInferError, match="tiny-org/gated is gated .* https://huggingface.co/tiny-org/gated"):
        load("tiny-org/gated")


@pytest.mark.parametrize("name", ["not/a/hub/id/nor/a/folder", "no-such-folder", "/abs/missing"])
def test_a_missing_path_that_is_not_a_hub_id(hub, name):
    with pytest.raises(DeepInferError, match=f"model path {name} is not a directory, and not a Hugging Face Hub id"):
        load(name)


def test_a_file_is_not_a_checkpoint(hub, tmp_path):
    file = tmp_path / "weights.bin"
    file.write_bytes(b"")
    with pytest.raises(DeepInferError, match="is not a directory"):
        load(file)
