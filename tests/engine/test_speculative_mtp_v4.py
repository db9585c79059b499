"""Speculative decoding with DeepSeek-V4's MTP layer as the drafter (model/mtp_v4.py), on a tiny checkpoint whose
MTP block is a transformers decoder layer stored as DeepSeek stores it (`mtp.0.*`): the drafter's logits at every
position of a prompt equal an independent computation (transformers' V4 decoder layer between the MTP inputs
and head written out here in torch); output is plain decoding's (greedy, seeded, chunked prefill, two
backends); the k chained drafts after every step of a batch equal the independent computation's, through
verify steps that keep some drafts and reject others; and the errors a wrong checkpoint gets."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from deepinfer_core.engine.llm import LLM
from deepinfer_core.kv.layout import ring_slots
from deepinfer_core.model.loader import CheckpointError
from deepinfer_core.sampling.params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see tests/conftest.py

LOOP = [5, 6, 7, 8, 9] * 6
PROMPTS = [LOOP[:13], list(range(30, 51)), [4, 3] * 3]  # beyond the sliding window (8) and within it
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _llm(checkpoint, accelerator="rowwise_cpu", k: int | None = 3, **kwargs) -> LLM:
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    return LLM(model=checkpoint, accelerator=accelerator, block_size=16, progress=False, speculative_config=spec,
               **kwargs)  # fmt: skip


# ---- the MTP math against an independent computation ----------------------------------------------------------


def _rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x if weight is None else x * weight


@torch.no_grad()
def _mtp_streams(ckpt, tokens: list[int], next_tokens: list[int], chained: list[torch.Tensor] = ()) -> torch.Tensor:
    """The MTP block's output streams [S, N, D] at positions 0..S-1 of `tokens`, from the facts: the model's last
    layer's streams h (before the head collapse) and the embedding e of the next token (`next_tokens`; zero at
    position 0) start every stream as e_proj(enorm(e)) + h_proj(hnorm(h_n)), then the block (here transformers'
    decoder layer) runs. The last len(`chained`) positions read those streams [N, D] as h instead (a chained
    draft reads the block's output at the position before)."""
    hf, mtp, eps = ckpt.hf_model, ckpt.mtp, ckpt.hf_model.config.rms_norm_eps
    following, count = torch.tensor([next_tokens]), len(tokens)
    block = hf.model.layers[-1]

    def start_streams(module, args, kwargs):  # args[0]: the model's last layer's streams [1, S, N, D]
        h = torch.cat([args[0][0, : count - len(chained)], *(s[None] for s in chained)])[None]
        embedded = hf.model.embed_tokens(following) * (torch.arange(count) != 0)[None, :, None]
        e = F.linear(_rms(embedded, mtp["enorm.weight"], eps), mtp["e_proj.weight"])  # [1, S, D]
        h = F.linear(_rms(h, mtp["hnorm.weight"], eps), mtp["h_proj.weight"])  # [1, S, N, D]
        return (h + e[:, :, None, :],), {**kwargs, "input_ids": following}

    out = {}

    def keep(module, args, streams) -> None:  # [1, S, N, D]
        out["streams"] = streams[0]

    hooks = [block.register_forward_pre_hook(start_streams, with_kwargs=True), block.register_forward_hook(keep)]
    try:
        hf(torch.tensor([tokens]))
    finally:
        for hook in hooks:
            hook.remove()
    return out["streams"]


@torch.no_grad()
def _mtp_logits(ckpt, streams: torch.Tensor) -> torch.Tensor:
    """The MTP layer's head: its own head mixer collapses streams [S, N, D], its `norm` and the model's LM head
    give logits [S, V]."""
    mtp, cfg = ckpt.mtp, ckpt.hf_model.config
    mixes = F.linear(_rms(streams.flatten(1), None, cfg.rms_norm_eps), mtp["hc_head_fn"])  # [S, N]
    pre = torch.sigmoid(mixes * mtp["hc_head_scale"] + mtp["hc_head_base"]) + cfg.hc_eps
    collapsed = (pre[:, :, None] * streams).sum(dim=1)  # [S, D]
    return F.linear(_rms(collapsed, mtp["norm.weight"], cfg.rms_norm_eps), ckpt.hf_model.lm_head.weight)


def _expected_drafts(ckpt, tokens: list[int], k: int) -> list[int]:
    """The k greedy drafts after `tokens` (its last token sampled, not yet computed): the MTP layer at the last
    computed position, then chained one position further each time."""
    drafts, chained = [], []
    for _ in range(k):
        streams = _mtp_streams(ckpt, tokens[:-1] + drafts, tokens[1:] + drafts, chained)
        drafts.append(int(_mtp_logits(ckpt, streams[-1:]).argmax()))
        chained.append(streams[-1])
    return drafts


def _drafter_logits(llm: LLM, prompt: list[int]) -> tuple[torch.Tensor, int]:
    """The drafter's logits [T, V] at every prompt position (its catch-up over the prefill), and the token the
    prefill sampled (the next token of the last position)."""
    drafter = llm.engine.runner.drafter
    outputs, real = [], drafter.forward

    def recording(*args):
        outputs.append(real(*args))
        return outputs[-1]

    drafter.forward = recording
    [result] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return drafter.logits(outputs[0]), result.outputs[0].token_ids[0]


@pytest.mark.parametrize("reads", ["streams", "final hidden"])
def test_the_drafters_logits_are_the_mtp_layers(hf_v4_mtp_checkpoint, reads):
    """Every position of a prompt longer than the window. Negative control: a drafter fed the final hidden
    state (after the head collapse and norm, what V3's MTP reads) in every stream fails the check."""
    prompt = torch.randint(0, 256, (21,), generator=torch.Generator().manual_seed(5)).tolist()
    llm = _llm(hf_v4_mtp_checkpoint.path, "cpu", 1, dtype="float32")
    if reads == "final hidden":
        drafter, real = llm.engine.runner.drafter, llm.engine.runner.drafter.target_forward

        def final_hidden(*args):
            hidden, streams = real(*args)
            return hidden, hidden[:, None, :].expand_as(streams)

        drafter.target_forward = final_hidden
    mine, sampled = _drafter_logits(llm, prompt)
    want = _mtp_logits(hf_v4_mtp_checkpoint, _mtp_streams(hf_v4_mtp_checkpoint, prompt, prompt[1:] + [sampled]))
    assert want.std() > 0.5  # far from flat: the comparison has teeth
    if reads == "streams":
        torch.testing.assert_close(mine, want)
    else:
        with pytest.raises(AssertionError, match="Tensor-likes are not close"):
            torch.testing.assert_close(mine, want)


# ---- the engine -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("accelerator", ["cpu", "rowwise_cpu"])
def test_mtp_output_is_the_plain_output(hf_v4_mtp_checkpoint, accelerator):
    prompts = [LOOP, list(range(30, 70)), [4, 3] * 9]
    greedy = SamplingParams(temperature=0, max_tokens=19, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, seed=11, max_tokens=17, ignore_eos=True)
    params = [greedy, seeded, seeded]
    want = _llm(hf_v4_mtp_checkpoint.path, accelerator, None).generate(prompts, params, use_tqdm=False)
    spec = _llm(hf_v4_mtp_checkpoint.path, accelerator, max_num_batched_tokens=24)  # long prompts: chunked
    got = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    stats = spec.engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_drafts <= stats.num_draft_tokens <= 3 * stats.num_drafts


def _steer(request, plain: list[int]) -> None:
    """Make the request's next step verify the plain continuation's next 0..3 tokens, then wrong ones: verify
    steps keep some drafts and reject the rest."""
    done = len(request.output_token_ids)
    request.next_draft_token_ids = (plain[done : done + done % 4] + [7, 8, 9])[:3]


def _drafts_per_step(path, llm: LLM, prompts: list[list[int]], steer: bool = True) -> list[tuple[list, list]]:
    """(a request's tokens, the drafts the drafter made for its next step) after every step, of each request
    still running, all started together. `steer`: each step then verifies `_steer`'s drafts instead."""
    plain = _llm(path, k=None).generate(prompts, GREEDY, use_tqdm=False)
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    requests = [engine._requests[str(i)].samples[0] for i in range(len(prompts))]
    seen = []
    while engine.has_unfinished():
        engine.step()
        for request, output in zip(requests, plain):
            if not request.finished:
                seen.append((list(request.all_token_ids), list(request.next_draft_token_ids)))
                if steer:
                    _steer(request, list(output.outputs[0].token_ids))
    return seen


def test_the_drafts_of_every_step_are_the_mtp_layers(hf_v4_mtp_checkpoint):
    """Three requests in one batch, after every step: the prefill's drafts, then those after verify steps that
    kept some drafts and wrote the rejected ones past the sequence (overwritten later), equal the independent
    computation's from the same tokens. So the drafter's window ring held exactly each sequence, and each
    chained draft read its own sequence's ring."""
    path = hf_v4_mtp_checkpoint.path
    llm = _llm(path)
    seen = _drafts_per_step(path, llm, PROMPTS)
    assert len(seen) >= 3 * 5 and all(len(drafts) == 3 for _, drafts in seen)
    stats = llm.engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # some drafts kept, some rejected
    for tokens, drafts in seen:
        assert drafts == _expected_drafts(hf_v4_mtp_checkpoint, tokens, 3), f"after {len(tokens)} tokens"


def test_the_check_fails_for_a_drafter_that_skips_its_catch_up(hf_v4_mtp_checkpoint):
    """Negative control: a drafter whose ring misses the steps' positions drafts otherwise."""
    path = hf_v4_mtp_checkpoint.path
    llm = _llm(path)
    drafter, real = llm.engine.runner.drafter, llm.engine.runner.drafter.draft

    def without_catch_up(step, caches, k):  # the catch-up writes copies: the real ring never sees it
        return real(step, [{name: cache.clone() for name, cache in layer.items()} for layer in caches], k)

    drafter.draft = without_catch_up
    seen = _drafts_per_step(path, llm, PROMPTS[:1])
    assert any(drafts != _expected_drafts(hf_v4_mtp_checkpoint, tokens, 3) for tokens, drafts in seen)


def _drafter_window_after(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    """Run `prompts` in turn (all but the last to their first token), then the last one's prefill: the
    drafter's window entries [W, D] of that prefill's last W positions."""
    for prompt in prompts[:-1]:
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    engine, prompt = llm.engine, prompts[-1]
    engine.add_request("last", prompt, SamplingParams(temperature=0, max_tokens=4))
    request = engine._requests["last"].samples[0]
    engine.step()
    spec = engine.runner.drafter.cache_specs[0]["window"]
    ring = engine.runner.caches[len(engine.model.cache_specs)]["window"]
    positions = torch.arange(len(prompt) - spec.window, len(prompt))
    entries = engine.backend.kv_layout.gather(ring, spec, ring_slots(request.seq_slot, positions, spec.ring_size))
    return entries, request.num_cached_tokens


def test_a_prefix_hit_rebuilds_the_drafters_window(hf_v4_mtp_checkpoint):
    """A hit replays enough tokens to rebuild the drafter's window from exact hidden states too (one more
    layer's reach than the model's own replay): its entries are those of a run without the hit. With only
    the model's replay they are not (the control)."""
    path = hf_v4_mtp_checkpoint.path
    shared = [(7 * i) % 90 + 3 for i in range(64)]  # 4 blocks
    first, second = shared + [50, 51, 52], shared + [60, 61, 62, 63]
    want, _ = _drafter_window_after(_llm(path, enable_prefix_caching=False), [second])
    got, cached = _drafter_window_after(_llm(path), [first, second])
    assert cached == 64, "no prefix hit"
    torch.testing.assert_close(got, want)
    short = _llm(path)
    short.engine.blocks.replay_tokens -= short.engine.runner.drafter.replay_tokens
    got, _ = _drafter_window_after(short, [first, second])
    assert not torch.allclose(got, want, rtol=1e-4, atol=1e-5)


# ---- errors -----------------------------------------------------------------------------------------------------


def _with_config(checkpoint, tmp_path, **changes):
    copy = shutil.copytree(checkpoint, tmp_path / "checkpoint")
    raw = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(raw | changes))
    return copy


def test_a_checkpoint_without_mtp_weights_is_refused(hf_v4_checkpoint, hf_v4_mtp_checkpoint, tmp_path):
    # transformers' save_pretrained: num_nextn_predict_layers 1 (its default), no mtp.* tensors
    saved = hf_v4_checkpoint("sliding").path
    assert json.loads((saved / "config.json").read_text())["num_nextn_predict_layers"] == 1
    with pytest.raises(CheckpointError, match=r"MTP layer \(mtp\.0\.\*\).*missing .*mtp\.0\..*transformers drops"):
        _llm(saved)
    none = _with_config(hf_v4_mtp_checkpoint.path, tmp_path, num_nextn_predict_layers=0)
    with pytest.raises(CheckpointError, match="num_nextn_predict_layers = 0"):
        _llm(none)


def test_a_compressed_mtp_layer_is_refused(hf_v4_mtp_checkpoint, tmp_path):
    raw = json.loads((hf_v4_mtp_checkpoint.path / "config.json").read_text())
    types = raw["layer_types"][:-1] + ["compressed_sparse_attention"]
    compressed = _with_config(hf_v4_mtp_checkpoint.path, tmp_path, layer_types=types)
    with pytest.raises(CheckpointError, match=r"layer_types\[3\] = 'compressed_sparse_attention'.*sliding-window"):
        _llm(compressed)
