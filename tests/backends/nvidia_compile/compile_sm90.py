"""Compile every nvidia_sm100 kernel launch for SM90 (Hopper) on a machine without a GPU.

Run as a script (not under Triton's interpreter): each launcher is called with small CPU tensors, and
the kernel launch is replaced by `triton.compile` of the same kernel, argument types and constexprs
for a CUDA compute-capability-9.0 target, down to a cubin (Triton ships ptxas). Catches what the
interpreter accepts but the compiler refuses. Prints one line per compiled kernel variant.
"""

from __future__ import annotations

import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

TARGET = GPUTarget("cuda", 90, 32)
POINTER_TYPES = {
    torch.float32: "*fp32",
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.int64: "*i64",
    torch.int32: "*i32",
    torch.float8_e4m3fn: "*fp8e4nv",
    torch.bool: "*i1",
    torch.uint8: "*u8",
}
# PTX a kernel must not contain: round_to_format is bitwise the reference's only with correctly rounded
# divisions (not div.full / div.approx), no contracted multiply-adds and no flushed subnormals
FORBIDDEN_PTX = {name: ("div.full", "div.approx", "fma.", ".ftz") for name in ("_round_kernel", "_pack_kernel")}
compiled: list[str] = []


def _type_of(value) -> str:
    if isinstance(value, torch.Tensor):
        return POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i64" if not -(2**31) <= value < 2**31 else "i32"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"cannot type kernel argument {value!r}")


def compile_instead(self: JITFunction, *args, grid, warmup, **kwargs):
    bound = dict(zip(self.arg_names, args))
    bound.update({k: v for k, v in kwargs.items() if k in self.arg_names})
    signature, constexprs = {}, {}
    for param in self.params:
        value = bound[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", value
        else:
            signature[param.name] = _type_of(value)
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    kernel = triton.compile(ASTSource(self, signature, constexprs), target=TARGET, options=options)
    assert "cubin" in kernel.asm, f"{self.__name__}: no cubin"
    for instruction in FORBIDDEN_PTX.get(self.__name__, ()):
        assert instruction not in kernel.asm["ptx"], f"{self.__name__} {constexprs}: {instruction} in its PTX"
    compiled.append(f"{self.__name__} {sorted(constexprs.items())}")


def launch_v4_attention(dtype: torch.dtype) -> None:
    """DeepSeek-V4 Flash's attention layers: 64 heads of 512 over a ring of 128 + 6 and blocks of 128 tokens, the
    window alone, CSA (rate 4, the entries its indexer of 64 heads of 128 picks, top 512) and HCA (rate 128), the
    latter two both split over the keys (and merged) and in a single pass."""
    from deepinfer_core.backend.ops import AttentionMetadata
    from deepinfer_core.kv.layout import CacheKind, CacheSpec
    from deepinfer_nvidia_sm100.kernels import indexer, sparse_attention

    tables, seq_slots, window_starts = torch.tensor([[5, 1, 2], [0, 4, -1]]), torch.tensor([1, 0]), torch.zeros(2)
    meta = AttentionMetadata(torch.tensor([0, 3, 4]), torch.tensor([300, 70]), tables, torch.arange(4),
                             seq_slots=seq_slots, window_starts=window_starts.long())  # fmt: skip
    ring_spec = CacheSpec(CacheKind.SLIDING_WINDOW, dtype, 1, 512, window=128, rollback_slots=6)
    ring, kv = torch.zeros(2 * ring_spec.ring_size, 1, 512, dtype=dtype), torch.randn(4, 512).to(dtype)
    q, sinks = torch.randn(4, 64, 512).to(dtype), torch.zeros(64)
    sparse_attention.sparse_attention(q, kv, ring, ring_spec, meta, 128, sinks=sinks, scale=0.04)
    for rate, indices in ((4, torch.randint(-1, 75, (4, 512))), (128, None)):
        comp_spec = CacheSpec(CacheKind.PAGED, dtype, 1, 512, compress_rate=rate)
        compressed = torch.zeros(6 * (128 // rate), 1, 512, dtype=dtype)
        comp = dict(compressed=compressed, compressed_spec=comp_spec, indices=indices)
        for split in (True, False):  # the split launch (and merge), the single pass
            sparse_attention.sparse_attention(q, kv, ring, ring_spec, meta, 128, sinks=sinks, scale=0.04, **comp,
                                              split=split)  # fmt: skip
    keys_spec = CacheSpec(CacheKind.PAGED, dtype, 1, 128, compress_rate=4)
    keys = torch.zeros(6 * 32, 1, 128, dtype=dtype)
    index_q, weights = torch.randn(4, 64, 128).to(dtype), torch.randn(4, 64)
    indexer.indexer_topk(index_q, weights, keys, keys_spec, meta, 128, top_k=512, scale=128**-0.5)
    indexer.indexer_select(index_q, weights, keys, keys_spec, meta, 128, top_k=512, scale=128**-0.5,
                           within=torch.randint(-1, 10, (4, 16)), candidate_block=8, top_blocks=16)  # fmt: skip


def launch_packed_reads(dtype: torch.dtype) -> None:
    """V4.1 Flash's attention over its packed caches: the FP8 window ring (512 + 16 bytes a row, staged) with FP4
    entries (256 + 32, e4m3 scales) staged and decoded in the kernel, by both launches, and the indexer over FP4
    keys (64 + 4, e8m0 scales), staged and not."""
    from deepinfer_core.backend.ops import AttentionMetadata
    from deepinfer_core.kv.layout import CacheKind, CacheSpec
    from deepinfer_nvidia_sm100.kernels import indexer, sparse_attention

    tables = torch.tensor([[5, 1, 2], [0, 4, -1]])
    meta = AttentionMetadata(torch.tensor([0, 3, 4]), torch.tensor([300, 70]), tables, torch.arange(4),
                             seq_slots=torch.tensor([1, 0]), window_starts=torch.zeros(2).long())  # fmt: skip
    ring_spec = CacheSpec(CacheKind.SLIDING_WINDOW, dtype, 1, 512, window=128, rollback_slots=6,
                          stored_format="fp8_e4m3/pow2:32")  # fmt: skip
    comp_spec = CacheSpec(CacheKind.PAGED, dtype, 1, 512, compress_rate=2, stored_format="fp4_e2m1/e4m3:16")
    ring, compressed = torch.zeros(268, 528, dtype=torch.uint8), torch.zeros(6 * 64, 288, dtype=torch.uint8)
    q, kv, sinks = torch.randn(4, 64, 512).to(dtype), torch.randn(4, 512).to(dtype), torch.zeros(64)
    for split in (True, False):
        for stage in (True, False):
            sparse_attention.sparse_attention(q, kv, ring, ring_spec, meta, 128, sinks=sinks, scale=0.04,
                                              split=split, compressed=compressed, compressed_spec=comp_spec,
                                              indices=torch.randint(-1, 75, (4, 512)), stage=stage)  # fmt: skip
    keys_spec = CacheSpec(CacheKind.PAGED, dtype, 1, 128, compress_rate=2, stored_format="fp4_e2m1/pow2:32")
    keys, index_q = torch.zeros(6 * 64, 68, dtype=torch.uint8), torch.randn(4, 64, 128).to(dtype)
    for stage in (True, False):
        indexer.index_scores(index_q, torch.randn(4, 64), keys, keys_spec, meta, 128, scale=128**-0.5, stage=stage)


def launch_dspark_block(dtype: torch.dtype) -> None:
    """DSpark's block attention at V4.1 Flash's width: 64 heads of 512 over the window ring (128 + 6), plain and
    packed in the FP8 window format (staged), blocks of 5 rows."""
    from deepinfer_core.backend.ops import AttentionMetadata
    from deepinfer_core.kv.layout import CacheKind, CacheSpec
    from deepinfer_nvidia_sm100.kernels import block_attention

    meta = AttentionMetadata(torch.tensor([0, 5, 10]), torch.tensor([300, 70]), torch.zeros(2, 1).long(),
                             torch.arange(10), seq_slots=torch.tensor([1, 0]), window_starts=torch.zeros(2).long(),
                             max_query_len=5)  # fmt: skip
    q, kv, sinks = torch.randn(10, 64, 512).to(dtype), torch.randn(10, 512).to(dtype), torch.zeros(64)
    for stored_format, ring in (("", torch.zeros(268, 1, 512, dtype=dtype)),
                                ("fp8_e4m3/pow2:32", torch.zeros(268, 528, dtype=torch.uint8))):  # fmt: skip
        spec = CacheSpec(CacheKind.SLIDING_WINDOW, dtype, 1, 512, window=128, rollback_slots=6,
                         stored_format=stored_format)  # fmt: skip
        block_attention.block_attention(q, kv, ring, spec, meta, sinks=sinks, scale=0.04)


def launch_v41(dtype: torch.dtype) -> None:
    """DeepSeek-V4.1's ops: hyper-connections of 4 streams of 5120 (the rms of the mixing GEMM's input, hc_mixes'
    pre, the collapse by a given pre, the float32 expansion), the block roundings of the window KV and compressed
    entries ([T, 512]) and of the index keys ([T, 128]) in every format, and the engram gate."""
    from deepinfer_core.backend.ops import BLOCK_FORMATS
    from deepinfer_core.kv.formats import BlockFormat
    from deepinfer_nvidia_sm100.kernels import engram, hyper, rounding

    streams, block_out = torch.randn(3, 4, 5120).to(dtype), torch.randn(3, 5120).to(dtype)
    hyper.hc_norm(streams, 1e-6)
    hyper.hc_mix(streams, torch.randn(3, 24), torch.ones(3), torch.zeros(24), 20, 1e-6, collapse=False)
    hyper.hc_collapse(streams, torch.rand(3, 4))
    hyper.hc_post(block_out, streams, torch.rand(3, 4), torch.rand(3, 4, 4), round_terms=False)
    for fmt in BLOCK_FORMATS:
        for width in (512, 128):
            rounding.round_to_format(torch.randn(3, width).to(dtype), fmt)
            rows = BlockFormat.of(fmt).row_bytes(width)
            rounding.pack_rows(torch.randn(3, width).to(dtype), fmt, torch.zeros(8, rows, dtype=torch.uint8),
                               torch.tensor([5, 0, 2]))  # fmt: skip
    launch_packed_reads(dtype)
    dead = torch.zeros(3, dtype=torch.bool)
    dead = torch.zeros(3, dtype=torch.bool)
    engram.engram_gate(streams, streams, block_out, torch.randn(4, 5120), dead, 1e-6)


def launch_everything() -> None:
    from deepinfer_core.backend.ops import MXFP4, AttentionMetadata, BlockFP8, RoutingConfig
    from deepinfer_core.kv.layout import CacheKind, CacheSpec
    from deepinfer_nvidia_sm100.kernels import attention, bitmask, elementwise, gemm, hyper, moe, noise, routing

    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(8, 2048).to(dtype)
        elementwise.rms_norm(x, torch.ones(2048, dtype=dtype), 1e-6)
        elementwise.rotary(torch.randn(8, 16, 64).to(dtype), torch.arange(8), torch.ones(64, 32), torch.zeros(64, 32),
                           interleaved=True)  # fmt: skip
        elementwise.rotary(torch.randn(8, 1, 64).to(dtype), torch.arange(8), torch.ones(64, 32), torch.zeros(64, 32),
                           interleaved=False)  # fmt: skip
        elementwise.silu_and_mul(torch.randn(8, 2816).to(dtype))
        elementwise.silu_and_mul(torch.randn(8, 2816).to(dtype), limit=10.0)  # V4's swiglu limit
        gemm.matmul(x, torch.randn(576, 2048).to(dtype), torch.randn(576).to(dtype))  # split-K and bias
        gemm.matmul(x, torch.randn(8192, 2048).to(dtype))  # no split
        gemm.batched_matmul(torch.randn(16, 8, 128).to(dtype), torch.randn(16, 512, 128).to(dtype))
        gemm.matmul(x, BlockFP8.quantize(torch.randn(576, 2048)))  # FP8 weight
        gemm.matmul(x, BlockFP8.quantize(torch.randn(576, 2048), (128, 128), "e8m0"))  # V4: E8M0 scales
        gemm.matmul(x, BlockFP8.quantize(torch.randn(576, 2048), (32, 32), "e8m0"))  # V4.1: 32 inside a K tile
        gemm.matmul(x, MXFP4.quantize(torch.randn(576, 2048)))  # FP4: dot_scaled with bf16 rows, halves with float32
        for rows in (4, 256):  # the default mode's tilings of a quantized weight (16-row, 128 x 128)
            fp8 = BlockFP8.quantize(torch.randn(576, 2048), (128, 128), "e8m0")
            gemm.matmul(torch.randn(rows, 2048).to(dtype), fp8, fixed_tiles=False)
        w13, w2 = torch.randn(4, 256, 256).to(dtype), torch.randn(4, 256, 128).to(dtype)
        for rows in (8, 4 * 512):  # fixed and large tiles
            counts = torch.full((4,), rows // 4, dtype=torch.int64)
            counts[0] += rows - int(counts.sum())
            moe.expert_ffn(torch.randn(rows, 256).to(dtype), counts, w13, w2, fixed_tiles=False)
            moe.expert_ffn(torch.randn(rows, 256).to(dtype), counts, w13, w2, fixed_tiles=False, swiglu_limit=10.0)
        moe.expert_ffn(torch.randn(8, 256).to(dtype), counts, BlockFP8.quantize(w13.float()),
                       BlockFP8.quantize(w2.float()))  # fmt: skip
        moe.expert_ffn(torch.randn(8, 256).to(dtype), counts, BlockFP8.quantize(w13.float()),
                       BlockFP8.quantize(w2.float()), swiglu_limit=10.0)  # fmt: skip
        moe.expert_ffn(torch.randn(8, 256).to(dtype), counts, BlockFP8.quantize(w13.float(), (32, 32), "e8m0"),
                       BlockFP8.quantize(w2.float(), (32, 32), "e8m0"), row_scales=torch.rand(8))  # fmt: skip
        for fixed in (True, False):  # FP4 experts (V4 / V4.1), both tilings
            moe.expert_ffn(torch.randn(8, 256).to(dtype), counts, MXFP4.quantize(w13.float()),
                           MXFP4.quantize(w2.float()), fixed_tiles=fixed, swiglu_limit=10.0)  # fmt: skip
        # DeepSeek-V4 Flash's shapes: 4 streams of 4096, both mixer forms; CSA (2 x 4 slots) and HCA (128) pooling
        streams = torch.randn(3, 4, 4096).to(dtype)
        hyper.hc_norm(streams, 1e-6)
        for rows in (24, 4):
            hyper.hc_mix(streams, torch.randn(3, rows), torch.ones(3), torch.zeros(rows), 20, 1e-6)
        hyper.hc_post(torch.randn(3, 4096).to(dtype), streams, torch.rand(3, 4), torch.rand(3, 4, 4))
        for span in (8, 128):
            hyper.softmax_pool(torch.randn(5, span, 512).to(dtype), torch.randn(5, span, 512))
        for heads, kv_heads, entry, key, offset, value in ((16, 1, 576, 576, 0, 512), (4, 2, 64, 32, 32, 32)):
            spec = CacheSpec(CacheKind.PAGED, dtype, num_heads=kv_heads, head_dim=entry)
            tables = torch.zeros(2, 4, dtype=torch.int64)
            meta = AttentionMetadata(torch.tensor([0, 3, 4]), torch.tensor([10, 7]), tables, torch.arange(4))
            cache = torch.zeros(64, kv_heads, entry, dtype=dtype)
            attention.paged_attention(torch.randn(4, heads, key).to(dtype), cache, spec, meta, 16, scale=0.1,
                                      value_dim=value, value_offset=offset)  # fmt: skip
        launch_v4_attention(dtype)
        launch_v41(dtype)
        launch_dspark_block(dtype)
    for config in (
        RoutingConfig(num_experts=64, top_k=6, method="noaux_tc", scoring="sigmoid", normalize=True),
        RoutingConfig(num_experts=256, top_k=8, method="noaux_tc", scoring="sigmoid", num_groups=8, topk_groups=4),
        RoutingConfig(num_experts=64, top_k=6, method="group_limited_greedy", num_groups=8, topk_groups=3),
        RoutingConfig(num_experts=16, top_k=4),
        # DeepSeek-V4: sqrtsoftplus top-k with the correction bias (V4 Flash: 256 experts, 6 chosen), without it
        RoutingConfig(num_experts=256, top_k=6, scoring="sqrtsoftplus", normalize=True, routed_scaling_factor=1.5),
        RoutingConfig(num_experts=16, top_k=4, scoring="sqrtsoftplus"),
    ):
        bias = torch.zeros(config.num_experts) if config.method == "noaux_tc" or config.top_k == 6 else None
        routing.moe_route(torch.randn(5, config.num_experts), config, bias)
    for scoring, ids_dtype in (("sqrtsoftplus", torch.int64), ("softmax", torch.int32)):  # V4's hash routing
        config = RoutingConfig(num_experts=256, top_k=6, method="hash", scoring=scoring, normalize=True)
        expert_ids = torch.stack([torch.randperm(256)[:6] for _ in range(5)]).to(ids_dtype)
        routing.moe_route(torch.randn(5, 256), config, torch.zeros(256), expert_ids)
    noise.gumbel_noise(torch.tensor([1, 2]), torch.tensor([0, 5]), 102400)
    for dtype in (torch.float32, torch.bfloat16):  # structured outputs' token mask over DeepSeek's vocabulary
        bitmask.launch(torch.randn(4, 129280).to(dtype), torch.full((4, 4040), -1, dtype=torch.int32))


if __name__ == "__main__":
    JITFunction.run = compile_instead
    launch_everything()
    print("\n".join(compiled))
    print(f"{len(compiled)} kernel variants compiled for sm_90", file=sys.stderr)
