"""Shared fixtures: real installs of the test distributions in tests/distributions."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

collect_ignore = ["distributions"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked `long` run first: under pytest-xdist a worker starts each while the others take the rest,
    instead of one worker finishing it alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)  # stable: collection order otherwise


@pytest.fixture(autouse=True)
def _logging_as_found():
    """Each test leaves logging as it found it: a test running the CLI in-process (`deepinfer_core.cli.main`)
    installs DeepInfer's stderr handler and INFO levels, which would make a later test on the same worker see log
    lines on its captured stderr."""
    root = logging.getLogger()
    ours = [logging.getLogger(name) for name in ("deepinfer", "deepinfer_core", "deepinfer_conformance")]
    handlers, level, levels = list(root.handlers), root.level, [logger.level for logger in ours]
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for logger, before in zip(ours, levels):
        logger.setLevel(before)


DISTRIBUTIONS = Path(__file__).parent / "distributions"
PLUGINS = Path(__file__).parent.parent / "plugins"


@pytest.fixture(scope="session")
def install_distributions(tmp_path_factory):
    """install_distributions("test_backends", ...) -> a directory where pip installed those
    distributions (entry points included), to put on sys.path / PYTHONPATH. Cached per combination.
    Names are folders of tests/distributions or of plugins/."""
    cache: dict[tuple[str, ...], Path] = {}

    def install(*names: str) -> Path:
        key = tuple(sorted(names))
        if key not in cache:
            root = tmp_path_factory.mktemp("site-" + ("-".join(key) or "empty"))
            target = root / "site"
            target.mkdir()
            sources = []
            for name in key:  # build from a copy so the source tree stays clean
                source = DISTRIBUTIONS / name if (DISTRIBUTIONS / name).is_dir() else PLUGINS / name
                sources.append(str(shutil.copytree(source, root / "src" / name)))
            if sources:
                subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "pip",
                        "install",
                        "--quiet",
                        "--no-deps",
                        "--no-build-isolation",
                        "--no-index",
                        "--target",
                        str(target),
                        *sources,
                    ],
                    check=True,
                    capture_output=True,
                    text=True,
                )
            cache[key] = target
        return cache[key]

    return install


@pytest.fixture(scope="session")
def run_cli():
    """run_cli(args, site=None, env={}) -> CompletedProcess of the installed `deepinfer` command."""

    def run(args: list[str], site: Path | None = None, env: dict[str, str] | None = None):
        full_env = {k: v for k, v in os.environ.items() if k != "DEEPINFER_ACCELERATOR"}
        # one intra-op thread, as the serve tests' servers: the commands run tiny models, and a second OpenMP
        # thread on a shared 2-core machine made a demo-model `generate` 2-3x slower (see one_torch_thread)
        full_env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        if site is not None:
            full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), full_env.get("PYTHONPATH")]))
        full_env.update(env or {})
        exe = shutil.which("deepinfer", path=str(Path(sys.executable).parent))
        assert exe, "the deepinfer console script is not installed next to this Python"
        # a guard against a hang, not a timing check: a conformance run on 2 loaded cores took over 120 s
        return subprocess.run([exe, *args], capture_output=True, text=True, env=full_env, timeout=300)

    return run


TINY_V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 1,
    "num_attention_heads": 2,
    "q_lora_rank": None,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 8,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "n_shared_experts": 1,
    "max_position_embeddings": 256,
    "eos_token_id": 1,
}


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A tiny DeepSeek-V3 checkpoint (config.json + model.safetensors, random weights, no tokenizer),
    written without transformers: for engine tests that do not need the Hugging Face oracle."""
    import json

    import torch
    from safetensors.torch import save_file

    from deepinfer_core.model.config import DeepseekConfig
    from deepinfer_core.model.deepseek_v3 import expected_weights

    path = tmp_path_factory.mktemp("tiny-v3")
    generator = torch.Generator().manual_seed(0)
    shapes = expected_weights(DeepseekConfig.from_hf(TINY_V3_CONFIG))
    save_file(
        {name: torch.randn(shape, generator=generator) * 0.3 for name, shape in shapes.items()},
        str(path / "model.safetensors"),
    )
    (path / "config.json").write_text(json.dumps(TINY_V3_CONFIG))
    return path


@pytest.fixture(scope="session")
def mtp_checkpoint(tmp_path_factory):
    """The tiny DeepSeek-V3 of tiny_checkpoint's config with one MTP layer (num_nextn_predict_layers 1): the
    model's tensors, a decoder block as layer num_hidden_layers and the MTP inputs and head (model/mtp.py)."""
    import dataclasses
    import json

    from safetensors.torch import save_file

    from deepinfer_core.model.config import DeepseekConfig
    from deepinfer_core.model.deepseek_v3 import expected_weights
    from deepinfer_core.model.mtp import mtp_weight_shapes

    raw = {**TINY_V3_CONFIG, "num_nextn_predict_layers": 1}
    config = DeepseekConfig.from_hf(raw)
    deeper = dataclasses.replace(config, num_hidden_layers=config.num_hidden_layers + 1)
    shapes = {**expected_weights(deeper), **mtp_weight_shapes(config, {})}
    generator = torch.Generator().manual_seed(3)
    path = tmp_path_factory.mktemp("tiny-v3-mtp")
    save_file({name: torch.randn(shape, generator=generator) * 0.3 for name, shape in shapes.items()},
              str(path / "model.safetensors"))  # fmt: skip
    (path / "config.json").write_text(json.dumps(raw))
    return path


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module of tiny-model tests: faster than torch's default for tensors this
    small, and steady when other jobs share the cores (two threads on a busy 2-core machine were seen
    10x slower: each small op waits for a descheduled thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- tiny DeepSeek checkpoints built with transformers (parity tests) -------------------------------

_HELPER = "deepinfer_tests_hf_checkpoints"


def _helper(name: str = _HELPER, file: str = "hf_checkpoints.py"):
    """A helper file of tests/model as one module per process."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).parent / "model" / file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """hf_checkpoint("a" | "b") -> Checkpoint(variant, path, hf_model): saved with save_pretrained, built once."""
    pytest.importorskip("transformers")
    helper = _helper()
    root = tmp_path_factory.mktemp("hf-deepseek-v3")
    return lambda variant: helper.build_checkpoint(variant, root)


@pytest.fixture(scope="session")
def hf_v4_checkpoint(tmp_path_factory):
    """hf_v4_checkpoint("a" | "b" | "sliding") -> Checkpoint(variant, path, hf_model) of a tiny DeepSeek-V4."""
    pytest.importorskip("transformers")
    helper = _helper("deepinfer_tests_hf_v4_checkpoints", "hf_v4_checkpoints.py")
    root = tmp_path_factory.mktemp("hf-deepseek-v4")
    return lambda variant: helper.build_v4_checkpoint(variant, root)


@pytest.fixture(scope="session")
def hf_v4_mtp_checkpoint(tmp_path_factory):
    """MtpCheckpoint(path, hf_model, mtp) of a tiny DeepSeek-V4 with one MTP layer (hf_v4_checkpoints.py)."""
    pytest.importorskip("transformers")
    helper = _helper("deepinfer_tests_hf_v4_checkpoints", "hf_v4_checkpoints.py")
    return helper.build_v4_mtp_checkpoint(tmp_path_factory.mktemp("hf-deepseek-v4-mtp"))
