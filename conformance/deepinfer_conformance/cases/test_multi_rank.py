"""The multi-rank engine (deepinfer_core/parallel/data_parallel.py) on the backend under test: engine rank
processes in one expert-parallel world over the backend's process-group kind (its "torch_distributed:<kind>" in
Capabilities.communicators), against the same backend's engine in this process.

World size 1: one rank process whose MoE layers dispatch and combine through the backend's collectives (an
all-to-all with itself). World size 2: two ranks splitting the routed experts, on devices 0 and 1; skipped where
the backend has no device 1 (a CPU backend's devices are all this host).

Expected: float32 greedy tokens identical to the one-process engine's for every prompt, and their top logprobs
within float32 tolerance (a rank's expert GEMMs see other row batches than one engine's do).
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_conformance.harness import CapabilitySkip
from deepinfer_core.backend.resolve import resolve_backend
from deepinfer_core.engine.llm import LLM
from deepinfer_core.sampling.params import SamplingParams

PROMPT_LENGTHS = (3, 17, 40)
NEW_TOKENS = 12
TOP = 5


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def require_distributed(suite) -> None:
    if not any(c.startswith("torch_distributed:") for c in suite.capabilities.communicators):
        listed = ", ".join(suite.capabilities.communicators) or "none"
        raise CapabilitySkip(
            "communicators:torch_distributed",
            f"{suite.under_test.name} declares no torch_distributed:<kind> communicator (it lists {listed}); the "
            "multi-rank engine's ranks need one",
        )


def require_device(suite, index: int) -> None:
    try:
        resolve_backend(suite.under_test, dtype=torch.float32, device_index=index)
    except Exception as err:  # noqa: BLE001 - no such device: the host's, not the backend's, doing
        pytest.skip(f"world size {index + 1} needs device {index} of {suite.under_test.name}, which is absent ({err})")


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("model", ["v3", "v4"])
def test_greedy_float32_multi_rank(suite, check, tiny_v3, tiny_v4, model, world):
    require_distributed(suite)
    ours, _ = suite.pair(torch.float32)
    if world > 1:
        require_device(suite, world - 1)
    path = tiny_v3(32) if model == "v3" else tiny_v4
    options = {"num_kv_blocks": -(-2048 // ours.kv_layout.block_size) + 8, "enable_prefix_caching": False,
               "progress": False}  # fmt: skip
    single = LLM(path, backend=ours, **options)
    batch = prompts(single.model.config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=20)
    want = single.generate(batch, params, use_tqdm=False)
    ranks = LLM(path, accelerator=suite.under_test.name, dtype="float32", data_parallel_size=world,
                enable_expert_parallel=True, **options)  # fmt: skip
    try:
        got = ranks.generate(batch, params, use_tqdm=False)
    finally:
        ranks.engine.shutdown()
    actual, expected = [], []
    for g, w in zip(got, want):
        g, w = g.outputs[0], w.outputs[0]
        for ours_top, ref_top in zip(g.top_logprobs, w.top_logprobs):
            for token, value in list(ref_top.items())[:TOP]:
                actual.append(ours_top.get(token, float("nan")))
                expected.append(value)
    check.close(torch.tensor(actual), torch.tensor(expected), torch.float32,
                reduce_dim=single.model.config.vocab_size, what="top logprobs, multi-rank vs one engine")  # fmt: skip
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want], (
        f"greedy tokens of {world} rank(s) differ from the one-process engine's"
    )
