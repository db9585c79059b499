"""V4.1's attention and indexer kernels over its caches, three ways in one run: caches of plain bfloat16 rows (the
baseline: the bytes V4.1 would hold without its formats), packed in FP8 / FP4 with the rows staged
(kernels.packed.stage_ring / stage_blocks: decoded once a step into a bfloat16 scratch), and packed with the
top-k picks and index keys decoded in the kernels (stage=False; the ring is always staged). Each against the
bound of the bytes it must read, at the measured copy bandwidth.

    python bench/gpu_packed_reads.py --out bench/results/gpu_packed_reads_nvidia_h200.json

Shapes: V4.1 Flash's attention (64 heads of 512, a window of 128 in a ring of 134, compressed entries every
`--rate` tokens, top 512) and indexer (64 heads of 128), blocks of 128 tokens; decode steps of B sequences at a
context, and a prefill of prompts from scratch. --tiny: a few heads of 32 under Triton's interpreter (CPU
smoke run; its times mean nothing).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

if "--tiny" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, versions  # noqa: E402
from _gpu_measure import device_info, measure_copy_bandwidth, replayed_ms  # noqa: E402

from deepinfer_core.backend.ops import AttentionMetadata  # noqa: E402
from deepinfer_core.kv.formats import BlockFormat  # noqa: E402
from deepinfer_core.kv.layout import CacheKind, CacheSpec  # noqa: E402
from deepinfer_core.reference.kv import ReferenceKVLayout  # noqa: E402
from deepinfer_nvidia_sm100.kernels import indexer, sparse_attention  # noqa: E402
from deepinfer_nvidia_sm100.kv import NvidiaKVLayout  # noqa: E402

FORMATS = {"window": "fp8_e4m3/pow2:32", "compressed": "fp4_e2m1/e4m3:16", "index_keys": "fp4_e2m1/pow2:32"}
FLASH = dict(heads=64, dim=512, index_heads=64, index_dim=128, window=128, top_k=512, block=128)
TINY = dict(heads=4, dim=32, index_heads=4, index_dim=32, window=8, top_k=8, block=16)
SYSTEMS = {
    "plain": "caches of bfloat16 rows (no stored formats): the baseline",
    "staged": "packed caches, the step's rows decoded once into a bfloat16 scratch (stage=True)",
    "in_kernel": "packed caches, top-k picks and index keys decoded in the kernels (stage=False; ring staged)",
    "auto": "packed caches, staging chosen by the shapes (production)",
}


def _specs(shape: dict, rate: int, packed: bool) -> dict[str, CacheSpec]:
    fmt = FORMATS if packed else dict.fromkeys(FORMATS, "")
    bf16 = torch.bfloat16
    return {
        "window": CacheSpec(CacheKind.SLIDING_WINDOW, bf16, 1, shape["dim"], window=shape["window"], rollback_slots=6,
                            stored_format=fmt["window"]),
        "compressed": CacheSpec(CacheKind.PAGED, bf16, 1, shape["dim"], compress_rate=rate,
                                stored_format=fmt["compressed"]),
        "index_keys": CacheSpec(CacheKind.PAGED, bf16, 1, shape["index_dim"], compress_rate=rate,
                                stored_format=fmt["index_keys"]),
    }  # fmt: skip


class Case:
    """One step: `batch` sequences, each with `queries` new tokens after `context` cached ones."""

    def __init__(self, shape: dict, rate: int, batch: int, context: int, queries: int, device, seed: int = 0):
        g = torch.Generator(device=device).manual_seed(seed)
        self.shape, self.rate, self.device = shape, rate, device
        self.batch, self.context, self.queries = batch, context, queries
        block = shape["block"]
        seq_len = context + queries
        width = -(-seq_len // block)
        tokens = batch * queries
        self.meta = AttentionMetadata(
            query_start_loc=torch.arange(batch + 1, device=device) * queries,
            seq_lens=torch.full((batch,), seq_len, device=device),
            block_tables=torch.randperm(batch * width, generator=g, device=device).view(batch, width),
            slot_mapping=torch.zeros(tokens, dtype=torch.int64, device=device),
            seq_slots=torch.randperm(batch, generator=g, device=device),
            window_starts=torch.zeros(batch, dtype=torch.int64, device=device),
        )
        self.units = {"window": batch, "compressed": batch * width, "index_keys": batch * width}
        heads, dim = shape["heads"], shape["dim"]
        self.q = torch.randn(tokens, heads, dim, generator=g, device=device).bfloat16()
        self.kv = torch.randn(tokens, dim, generator=g, device=device).bfloat16()
        self.index_q = torch.randn(tokens, shape["index_heads"], shape["index_dim"], generator=g, device=device)
        self.index_q = self.index_q.bfloat16()
        self.weights = torch.randn(tokens, shape["index_heads"], generator=g, device=device)
        self.sinks = torch.zeros(heads, device=device)
        self.caches = {packed: self._caches(packed, g) for packed in (False, True)}

    def _caches(self, packed: bool, g) -> tuple[dict, dict]:
        layout = (NvidiaKVLayout if packed else ReferenceKVLayout)(self.device, self.shape["block"])
        specs, caches = _specs(self.shape, self.rate, packed), {}
        for name, spec in specs.items():
            cache = layout.allocate(spec, self.units[name])
            values = torch.randn(cache.shape[0], 1, spec.head_dim, generator=g, device=self.device).bfloat16()
            layout.write(cache, spec, torch.arange(cache.shape[0], device=self.device), values)
            caches[name] = cache
        return specs, caches

    def run(self, system: str):
        """The step's indexer scores, top-k and sparse attention on `system`'s caches."""
        specs, caches = self.caches[system != "plain"]
        stage = {"staged": True, "in_kernel": False}.get(system)
        scale = self.shape["index_dim"] ** -0.5
        scores, _ = indexer.index_scores(self.index_q, self.weights, caches["index_keys"], specs["index_keys"],
                                         self.meta, self.shape["block"], scale=scale, stage=stage)  # fmt: skip
        best = scores.topk(min(self.shape["top_k"], scores.shape[1]), dim=1)
        indices = torch.where(best.values > float("-inf"), best.indices, -1)
        return sparse_attention.sparse_attention(
            self.q, self.kv, caches["window"], specs["window"], self.meta, self.shape["block"], sinks=self.sinks,
            scale=self.shape["dim"] ** -0.5, compressed=caches["compressed"], compressed_spec=specs["compressed"],
            indices=indices, stage=stage,
        )  # fmt: skip

    def bytes_read(self, packed: bool) -> int:
        """What the step must read at least: q, kv and out once; each sequence's window entries, its queries'
        distinct picks (at most all its visible entries) and its index keys once."""
        shape, queries = self.shape, self.queries
        row = {
            name: BlockFormat.of(fmt).row_bytes(shape["index_dim" if name == "index_keys" else "dim"]) if packed
            else 2 * shape["index_dim" if name == "index_keys" else "dim"]
            for name, fmt in FORMATS.items()
        }  # fmt: skip
        visible = (self.context + queries) // self.rate
        per_seq = min(self.context, shape["window"]) * row["window"]
        per_seq += min(visible, queries * shape["top_k"]) * row["compressed"] + visible * row["index_keys"]
        activations = self.q.numel() * 2 * 2 + self.kv.numel() * 2 + self.index_q.numel() * 2
        return self.batch * per_seq + activations


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="tiny shapes under the interpreter: a CPU smoke run")
    parser.add_argument("--rate", type=int, default=2, help="tokens per compressed entry (default 2)")
    parser.add_argument("--decode", default=None, help="batch@context,... (default 1@144,64@144,256@144,"
                        "1@8192,64@8192,256@8192; tiny 1@20,3@40)")  # fmt: skip
    parser.add_argument("--prefill", default=None, help="prompts@length (default 8@1024; tiny 2@24)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per system (default 20; tiny 1)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.tiny else "cuda")
    shape = TINY if args.tiny else FLASH
    decode = args.decode or ("1@20,3@40" if args.tiny else "1@144,64@144,256@144,1@8192,64@8192,256@8192")
    prefill = args.prefill or ("2@24" if args.tiny else "8@1024")
    repeats = args.repeats or (1 if args.tiny else 20)
    bandwidth = measure_copy_bandwidth(device, 16 if args.tiny else 2048)
    cases = [("decode", *map(int, c.split("@")), 1) for c in decode.split(",")]
    for c in prefill.split(","):
        prompts, length = map(int, c.split("@"))
        cases.append(("prefill", prompts, 0, length))
    rows = []
    for kind, batch, context, queries in cases:
        case = Case(shape, args.rate, batch, context, queries, device)
        outs, row = {}, {"kind": kind, "batch": batch, "context": context, "queries_per_sequence": queries}
        for system in SYSTEMS:
            outs[system] = case.run(system)
            row[f"{system}_ms"] = replayed_ms(functools.partial(case.run, system), device, repeats, inner=5)
        for packed in (False, True):
            moved = case.bytes_read(packed)
            row["packed_bytes" if packed else "plain_bytes"] = moved
            row["packed_bound_ms" if packed else "plain_bound_ms"] = moved / (bandwidth["gb_per_s"] * 1e9) * 1e3
        row["staged_equals_in_kernel"] = torch.equal(outs["staged"], outs["in_kernel"])
        row["auto_equals_staged"] = torch.equal(outs["auto"], outs["staged"])
        rows.append(row)
        print(json.dumps(row), flush=True)
        del case, outs
    report = {
        "benchmark": "gpu_packed_reads",
        "command": " ".join(["python", "bench/gpu_packed_reads.py", *(argv if argv is not None else sys.argv[1:])]),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {**machine(), "device": device_info(device)},
        "versions": versions(),
        "shape": shape,
        "rate": args.rate,
        "formats": FORMATS,
        "systems": SYSTEMS,
        "method": "per system: the indexer's scores, the top-k of them, the sparse attention, timed together: "
        f"median of {repeats} replays of a CUDA graph of 5 such steps (on a GPU; eager on the CPU), one untimed "
        "run first; bound = bytes_read / copy bandwidth",
        "bytes_read": "each sequence's window entries, its queries' distinct picks (<= its visible entries) and "
        "index keys once, plus q, kv, index q and the output; the staged systems' scratch traffic is not counted",
        "copy_bandwidth": bandwidth,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
