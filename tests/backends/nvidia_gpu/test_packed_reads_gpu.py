"""On a GPU only (skipped elsewhere): the sparse attention (both launches) and the indexer read DeepSeek-V4.1's
packed caches (NvidiaKVLayout) as the same rounded values in plain rows, compiled for the GPU, at V4.1 Flash's
widths (rows of 528, 288 and 68 bytes) and at the test fixtures' (33, 18 and 17 bytes). Within bfloat16's
tolerance, not bit for bit: decoded in registers, an operand may take another MMA path than one loaded from
memory (the interpreter tests show the decode exact). The two launches over the packed caches agree bit for bit;
index keys staged (kernels.packed.stage_blocks) or decoded in the kernel give the same scores, bit for bit; top-k
picks staged or decoded in the attention kernel agree within bfloat16's rounding (their last bit has differed at
V4.1 Flash's width, which is why the batch-invariant mode does not choose between them by shapes)."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from deepinfer_core.backend.ops import AttentionMetadata  # noqa: E402
from deepinfer_core.kv.formats import round_blocks  # noqa: E402
from deepinfer_core.kv.layout import CacheKind, CacheSpec  # noqa: E402
from deepinfer_core.reference.kv import ReferenceKVLayout  # noqa: E402
from deepinfer_nvidia_sm100.kernels import indexer, sparse_attention  # noqa: E402
from deepinfer_nvidia_sm100.kv import NvidiaKVLayout  # noqa: E402

CUDA = torch.device("cuda")
WIDTHS = {"flash": (64, 512, 128), "fixture": (4, 32, 32)}  # heads, head_dim, index_head_dim
FORMATS = {"window": "fp8_e4m3/pow2:32", "compressed": "fp4_e2m1/e4m3:16", "index_keys": "fp4_e2m1/pow2:32"}
CONTEXTS, BLOCK, RATE = [3000, 700, 129, 5], 128, 2


def _specs(dim: int, index_dim: int, packed: bool) -> dict[str, CacheSpec]:
    fmt = FORMATS if packed else dict.fromkeys(FORMATS, "")
    return {
        "window": CacheSpec(CacheKind.SLIDING_WINDOW, torch.bfloat16, 1, dim, window=128, rollback_slots=6,
                            stored_format=fmt["window"]),
        "compressed": CacheSpec(CacheKind.PAGED, torch.bfloat16, 1, dim, compress_rate=RATE,
                                stored_format=fmt["compressed"]),
        "index_keys": CacheSpec(CacheKind.PAGED, torch.bfloat16, 1, index_dim, compress_rate=RATE,
                                stored_format=fmt["index_keys"]),
    }  # fmt: skip


@pytest.mark.parametrize("width", WIDTHS)
def test_packed_reads_give_the_plain_reads_bits(width):
    heads, dim, index_dim = WIDTHS[width]
    g = torch.Generator(device="cuda").manual_seed(0)
    batch, blocks = len(CONTEXTS), -(-max(CONTEXTS) // BLOCK)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, device=CUDA),
        seq_lens=torch.tensor(CONTEXTS, device=CUDA),
        block_tables=torch.arange(batch * blocks, device=CUDA).view(batch, blocks),
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device=CUDA),
        seq_slots=torch.arange(batch, device=CUDA),
        window_starts=torch.zeros(batch, dtype=torch.int64, device=CUDA),
    )
    units = {"window": batch, "compressed": batch * blocks, "index_keys": batch * blocks}
    caches = {}
    for packed, layout in ((True, NvidiaKVLayout(CUDA, BLOCK)), (False, ReferenceKVLayout(CUDA, BLOCK))):
        specs = _specs(dim, index_dim, packed)
        for name, spec in specs.items():
            cache = layout.allocate(spec, units[name])
            values = torch.randn(cache.shape[0], spec.head_dim, generator=g, device=CUDA)
            values = round_blocks(values.bfloat16(), FORMATS[name]) if packed else caches[True][1][name]
            layout.write(cache, spec, torch.arange(cache.shape[0], device=CUDA), values[:, None, :])
            caches.setdefault(packed, ({}, {}, specs))[0][name] = cache
            caches[packed][1][name] = values
    q = torch.randn(batch, heads, dim, generator=g, device=CUDA).bfloat16()
    kv = round_blocks(torch.randn(batch, dim, generator=g, device=CUDA).bfloat16(), FORMATS["window"])
    index_q = round_blocks(
        torch.randn(batch, heads, index_dim, generator=g, device=CUDA).bfloat16(), FORMATS["index_keys"]
    )
    weights, sinks = torch.randn(batch, heads, generator=g, device=CUDA), torch.zeros(heads, device=CUDA)
    outs = {}
    plain_indices = None
    for packed in (False, True):
        tensors, _, specs = caches[packed]
        scores, _ = indexer.index_scores(index_q, weights, tensors["index_keys"], specs["index_keys"], meta, BLOCK,
                                         scale=index_dim**-0.5)  # fmt: skip
        indices, _ = indexer.indexer_select(index_q, weights, tensors["index_keys"], specs["index_keys"], meta, BLOCK,
                                            top_k=64, scale=index_dim**-0.5)  # fmt: skip
        plain_indices = indices if plain_indices is None else plain_indices
        outs[packed] = [scores] + [
            sparse_attention.sparse_attention(q, kv, tensors["window"], specs["window"], meta, BLOCK, sinks=sinks,
                                              scale=dim**-0.5, compressed=tensors["compressed"],
                                              compressed_spec=specs["compressed"], indices=plain_indices, split=split)
            for split in (True, False)
        ]  # fmt: skip
    assert torch.equal(outs[True][1], outs[True][2])  # the split launch and the single pass
    tensors, _, specs = caches[True]
    for stage in (False, True):  # packed rows staged or decoded in the kernels
        scores, _ = indexer.index_scores(index_q, weights, tensors["index_keys"], specs["index_keys"], meta, BLOCK,
                                         scale=index_dim**-0.5, stage=stage)  # fmt: skip
        assert torch.equal(scores, outs[True][0]), stage
        out = sparse_attention.sparse_attention(q, kv, tensors["window"], specs["window"], meta, BLOCK, sinks=sinks,
                                                scale=dim**-0.5, compressed=tensors["compressed"],
                                                compressed_spec=specs["compressed"], indices=plain_indices,
                                                stage=stage)  # fmt: skip
        torch.testing.assert_close(out.float(), outs[True][1].float(), rtol=1.6e-2, atol=1e-2)
    for packed_out, plain_out in zip(outs[True], outs[False]):
        finite = packed_out.isfinite()
        assert torch.equal(finite, plain_out.isfinite())
        torch.testing.assert_close(packed_out[finite].float(), plain_out[finite].float(), rtol=1.6e-2, atol=1e-2)
