"""The backend's KV layout: whatever its physical layout, `gather` must give back exactly the canonical entries
written at each slot id, for every cache kind it declares, and the same canonical cache as the reference.

PAGED caches come plain (one entry per token) and compressed (DeepSeek-V4's `compress_rate` 4 and 8: a block
of block_size tokens holds block_size / rate entries, slot ids from `compressed_slots`); the compressed
variants skip with the backend's reason where it has neither V4 op that reads such caches. Caches with a
`stored_format` (DeepSeek-V4.1's FP8 / FP4 KV) must give back exactly the reference's rounding, and stay in the
format's bytes where the backend declares it in `kv_formats`."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer_conformance.harness import CapabilitySkip
from deepinfer_core.kv.formats import BlockFormat
from deepinfer_core.kv.layout import CacheKind, CacheSpec, compressed_slots, ring_slots

DTYPES = [torch.float32, torch.bfloat16]
# (kind, compress_rate) by case id; the plain kinds keep their ids
VARIANTS = {kind.value: (kind, 1) for kind in CacheKind} | {
    f"paged_c{rate}": (CacheKind.PAGED, rate) for rate in (4, 8)
}

# Units test_round_trip allocates per kind: blocks (PAGED) or sequence slots (SLIDING_WINDOW, SEQUENCE_STATE).
UNITS = {CacheKind.PAGED: 9, CacheKind.SLIDING_WINDOW: 5, CacheKind.SEQUENCE_STATE: 7}


def make_spec(kind: CacheKind, dtype: torch.dtype, rate: int = 1) -> CacheSpec:
    if kind is CacheKind.PAGED and rate > 1:  # V4's compressed entries: one head
        return CacheSpec(kind, dtype, num_heads=1, head_dim=80, compress_rate=rate)
    if kind is CacheKind.PAGED:  # two heads of an MLA-sized entry (64 + 16)
        return CacheSpec(kind, dtype, num_heads=2, head_dim=80)
    if kind is CacheKind.SLIDING_WINDOW:  # production V4.1 Flash ring: window 128 + 6 rollback slots
        return CacheSpec(kind, dtype, num_heads=1, head_dim=80, window=128, rollback_slots=6)
    return CacheSpec(kind, dtype, state_shape=(3, 48))


def randn(*shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def num_slots(layout, spec: CacheSpec, units: int) -> int:
    if spec.kind is CacheKind.PAGED:  # block_size / rate entries per block
        return units * spec.entries_per_block(layout.block_size)
    if spec.kind is CacheKind.SLIDING_WINDOW:
        return units * spec.ring_size
    return units


def kv_dtype_backend(suite, dtype: torch.dtype, kind: CacheKind, rate: int = 1):
    """(backend under test, reference) for a cache of `kind` stored in `dtype`, or skip with the reason."""
    suite.require_declared("cache_kinds", kind)
    if rate > 1:  # only V4's sparse_attention / indexer_topk read compressed caches
        reasons = [suite.capabilities.supports(op) for op in ("sparse_attention", "indexer_topk")]
        if True not in reasons:
            raise CapabilitySkip(
                "unsupported:sparse_attention",
                f"{suite.under_test.name} does not support compressed PAGED caches: {reasons[0]}",
            )
    if suite.capabilities.kv_dtypes:  # empty means the compute dtypes, which suite.pair checks
        suite.require_declared("kv_dtypes", str(dtype).removeprefix("torch."))
    ours, ref = suite.pair(dtype)
    if ours.kv_layout.block_size % rate:
        pytest.skip(f"{suite.under_test.name}'s block size {ours.kv_layout.block_size} is not a multiple of {rate}")
    return ours, ref


class Cache:
    """One layout's cache with the calls moving slots/values to its device and results back to CPU."""

    def __init__(self, backend, spec: CacheSpec, units: int) -> None:
        self.layout, self.spec, self.device = backend.kv_layout, spec, backend.torch_device
        self.tensor = self.layout.allocate(spec, units)
        self.size = num_slots(self.layout, spec, units)

    def write(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        self.layout.write(self.tensor, self.spec, slots.to(self.device), values.to(self.device))

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        return self.layout.gather(self.tensor, self.spec, slots.to(self.device)).cpu()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_round_trip(suite, check, variant, dtype):
    kind, rate = VARIANTS[variant]
    ours, _ = kv_dtype_backend(suite, dtype, kind, rate)
    spec = make_spec(kind, dtype, rate)
    cache = Cache(ours, spec, UNITS[kind])
    assert cache.tensor.device.type == ours.torch_device.type, f"cache on {cache.tensor.device}"
    everything = torch.arange(cache.size)
    check.equal(
        cache.gather(everything),
        torch.zeros(cache.size, *spec.entry_shape, dtype=dtype),
        what="freshly allocated cache (must be zeroed)",
    )

    # random distinct slots (about half of them), written in a random order, in two calls
    perm = torch.randperm(cache.size, generator=torch.Generator().manual_seed(1))
    written = perm[: max(2, cache.size // 2)]
    values = randn(len(written), *spec.entry_shape, seed=2, dtype=dtype)
    half = len(written) // 2
    cache.write(written[:half], values[:half])
    cache.write(written[half:], values[half:])
    expected = torch.zeros(cache.size, *spec.entry_shape, dtype=dtype)
    expected[written] = values
    check.equal(cache.gather(written), values, what="gather of written slots")
    check.equal(cache.gather(everything), expected, what="whole cache after writes (unwritten slots stay zero)")

    # overwrite a third of the written slots; the rest must not move
    again = written[torch.randperm(len(written), generator=torch.Generator().manual_seed(3))[: len(written) // 3 + 1]]
    new_values = randn(len(again), *spec.entry_shape, seed=4, dtype=dtype)
    cache.write(again, new_values)
    expected[again] = new_values
    check.equal(cache.gather(again), new_values, what="gather of overwritten slots")
    check.equal(cache.gather(everything), expected, what="whole cache after overwrite")


# PAGED writes of test_matches_reference: three sequences' prefills then two decode steps each. The logical
# positions are the same for every block size; 127 + 2 decodes crosses the 128 boundary (a block boundary
# for every block size dividing 128), 261 spans several blocks and ends mid-block. A compressed cache gets
# the entries those tokens complete (entry w once token w * rate + rate - 1 is written): 127 + 1 completes
# the last entry of a block at rate 4 and 8, 7 tokens none at rate 8 until its first decode.
PAGED_LENGTHS = [261, 127, 7]
DECODE_STEPS = 2


def write_calls(kind: CacheKind, spec: CacheSpec, layout, seed: int):
    """(units to allocate, slot ids of a realistic series of write calls, slots to read back afterwards in
    canonical order), in `layout`'s own slot numbering; the same logical entries for any block size."""
    if kind is CacheKind.PAGED:
        block_size, rate = layout.block_size, spec.compress_rate
        needed = [math.ceil((n + DECODE_STEPS) / block_size) for n in PAGED_LENGTHS]
        units = sum(needed) + 3  # spare blocks, so the shuffled tables are not contiguous
        order = torch.randperm(units, generator=torch.Generator().manual_seed(seed))
        ends = torch.tensor(needed).cumsum(0).tolist()
        tables = [order[end - count : end] for count, end in zip(needed, ends)]

        def slots(b: int, start: int, end: int) -> torch.Tensor:
            """Slot ids of what tokens start..end-1 of sequence b write: one entry per token (rate 1, where
            compressed_slots is paged_slots), or the compressed entries they complete."""
            return compressed_slots(tables[b], torch.arange(start // rate, end // rate), block_size, rate)

        calls = [slots(b, 0, n) for b, n in enumerate(PAGED_LENGTHS)]
        calls += [slots(b, n + step, n + step + 1) for step in range(DECODE_STEPS) for b, n in enumerate(PAGED_LENGTHS)]
        read = torch.cat([slots(b, 0, n + DECODE_STEPS) for b, n in enumerate(PAGED_LENGTHS)])
        return units, [c for c in calls if len(c)], read  # a step that completes no entry writes nothing
    if kind is CacheKind.SLIDING_WINDOW:
        # each sequence slot has a ring of window + rollback slots; positions a ring_size apart share a slot,
        # so the third and fifth calls overwrite what the second and first wrote
        ring = spec.ring_size
        calls = [
            ring_slots(0, torch.arange(40), ring),
            ring_slots(3, torch.arange(500, 500 + ring), ring),  # one full turn of the ring
            ring_slots(3, torch.arange(500 + ring, 510 + ring), ring),
            ring_slots(2, torch.tensor([1000]), ring),
            ring_slots(0, torch.arange(ring, ring + 5), ring),
        ]
        return UNITS[kind], calls, torch.arange(UNITS[kind] * ring)  # the whole cache, unwritten slots too
    # one state per sequence slot, rewritten every step
    calls = [torch.tensor([4, 1, 6]), torch.tensor([1]), torch.tensor([0, 4])]
    return UNITS[kind], calls, torch.arange(UNITS[kind])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_reference(suite, check, variant, dtype):
    kind, rate = VARIANTS[variant]
    ours, ref = kv_dtype_backend(suite, dtype, kind, rate)
    spec = make_spec(kind, dtype, rate)
    candidates = [ours]
    smallest = min(suite.capabilities.block_sizes)
    if kind is CacheKind.PAGED and smallest % rate == 0:  # also at the smallest block size: other slot ids
        candidates.append(suite.resolved(suite.under_test, dtype, smallest))

    def canonical(backend) -> torch.Tensor:
        units, calls, read = write_calls(kind, spec, backend.kv_layout, seed=5)
        cache = Cache(backend, spec, units)
        for i, slots in enumerate(calls):
            cache.write(slots, randn(len(slots), *spec.entry_shape, seed=100 + i, dtype=dtype))
        return cache.gather(read)

    expected = canonical(ref)
    for backend in candidates:
        check.equal(
            canonical(backend),
            expected,
            what=f"canonical {variant} cache (block size "
            f"{backend.kv_layout.block_size}) vs the reference's (block size {ref.kv_layout.block_size})",
        )


# DeepSeek-V4.1's caches with a stored_format (v41_attention): the window ring in FP8, compressed entries and
# indexer keys in FP4. (kind, compress_rate, head_dim) per format.
STORED = {
    "fp8_e4m3/pow2:32": (CacheKind.SLIDING_WINDOW, 1, 128),
    "fp4_e2m1/e4m3:16": (CacheKind.PAGED, 2, 128),
    "fp4_e2m1/pow2:32": (CacheKind.PAGED, 2, 64),
}


def format_inputs(rows: int, dim: int, seed: int) -> torch.Tensor:
    """[rows, 1, dim] float32 of the magnitudes a block meets: random rows from 1e-30 to 1e2, then rows of
    zeros, of values far below the scales' floors, of mixed magnitudes within a block, and of blocks whose
    e4m3 scale is subnormal with the largest element rounding to 4 (amax ~ 4.5 x 2 x 2^-9). Not past an amax
    of 6 x 448, where an e4m3 scale overflows (torch's float8 cast gives NaN before 2.12, 448 since)."""
    x = randn(rows, dim, seed=seed) * torch.logspace(-30, 2, rows)[:, None]
    x[0] = 0.0
    x[1] = randn(dim, seed=seed + 1) * 1e-39
    x[2] = randn(dim, seed=seed + 2) * torch.logspace(-6, 2, dim)
    x[3] = randn(dim, seed=seed + 3).clamp(-1, 1) * 0.0176
    x[3, ::16] = 0.0176
    return x[:, None, :]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", list(STORED))
def test_stored_format(suite, check, fmt, dtype):
    """Values rounded to a cache's stored_format by the reference's round_to_format come back from the backend's
    layout bit for bit (signed zeros too), written once and overwritten; a backend that declares the format in
    Capabilities.kv_formats must also keep the cache in the format's bytes (elements and scales), not more."""
    kind, rate, dim = STORED[fmt]
    suite.require_declared("cache_kinds", kind)
    ours, ref = kv_dtype_backend(suite, dtype, kind, rate)
    spec = CacheSpec(kind, dtype, 1, dim, window=128 if rate == 1 else 0, rollback_slots=6 if rate == 1 else 0,
                     compress_rate=rate, stored_format=fmt)  # fmt: skip
    cache = Cache(ours, spec, UNITS[kind])
    perm = torch.randperm(cache.size, generator=torch.Generator().manual_seed(6))
    expected = torch.zeros(cache.size, 1, dim, dtype=dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for seed, slots in ((7, perm[: cache.size // 2]), (8, perm[cache.size // 4 : cache.size // 2 + 5])):
        values = ref.ops.round_to_format(format_inputs(len(slots), dim, seed).to(dtype), fmt)
        cache.write(slots, values)
        expected[slots] = values
        check.equal(cache.gather(slots).view(bits), values.view(bits), what=f"{fmt} entries read back (bits)")
    check.equal(cache.gather(torch.arange(cache.size)).view(bits), expected.view(bits), what="the whole cache (bits)")
    if fmt in suite.capabilities.kv_formats:
        stored = cache.tensor.numel() * cache.tensor.element_size() / cache.size
        packed = BlockFormat.of(fmt).row_bytes(dim)
        check.metric(bytes_per_entry=stored, format_bytes=packed, canonical_bytes=dim * dtype.itemsize)
        assert stored <= packed, (
            f"{ours.name} declares {fmt} in kv_formats but stores {stored} bytes per entry, not {packed}"
        )


def test_block_sizes(suite, check):
    """The layout's default block size is a declared one, each declared size is honoured, and a PAGED round
    trip across block boundaries works at every declared size."""
    caps = suite.capabilities
    dtype = torch.float32 if "float32" in caps.dtypes else getattr(torch, caps.dtypes[0])
    suite.require_dtype(dtype)
    default = suite.resolved(suite.under_test, dtype).kv_layout.block_size
    assert default in caps.block_sizes, (
        f"{suite.under_test.name}'s layout uses {default}-token blocks, not among its declared block sizes "
        f"{caps.block_sizes}"
    )
    if CacheKind.PAGED not in caps.cache_kinds:
        check.metric(default_block_size=default, block_sizes=list(caps.block_sizes))
        return
    for size in caps.block_sizes:
        backend = suite.resolved(suite.under_test, dtype, size)
        assert backend.kv_layout.block_size == size, (
            f"asked for {size}-token blocks, the layout has block_size {backend.kv_layout.block_size}"
        )
        spec = make_spec(CacheKind.PAGED, dtype)
        cache = Cache(backend, spec, 3)
        # the first and last slot of each of blocks 0..2, in a shuffled order
        slots = torch.tensor([2 * size - 1, 0, 3 * size - 1, size - 1, 2 * size, size])
        values = randn(len(slots), *spec.entry_shape, seed=size, dtype=dtype)
        cache.write(slots, values)
        check.equal(cache.gather(slots), values, what=f"round trip at block size {size}")
    check.metric(
        max_abs_err=check.max_abs,
        max_rel_err=check.max_rel,
        tolerance=check.tolerance,
        default_block_size=default,
        block_sizes=list(caps.block_sizes),
    )
