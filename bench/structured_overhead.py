"""What structured outputs cost a decode (issue #19): the same requests with every request constrained and with
none, at several batch sizes, in one run; the per-token mask time per request from the engine's own timings
(deepinfer:structured_output_mask_seconds).

    python bench/structured_overhead.py --out bench/results/structured_overhead_cpu.json
    python bench/structured_overhead.py --accelerator nvidia --out bench/results/structured_overhead_nvidia_h200.json
    python bench/structured_overhead.py --accelerator nvidia --model v4-width \
        --out bench/results/structured_overhead_v4_width_nvidia_h200.json

--model demo (the default) is the embedded demo model: on a GPU its steps are bound by the host's launches, so
every microsecond of grammar work on the host shows in full. --model v4-width writes gpu_decode.py's V4-width
checkpoint (4 layers at V4 Flash's widths, 32 experts, random bf16 weights, the demo's V4 tokenizer) to a
temporary folder and serves it. At batch 64 even its 4-layer steps turned out bound by the host (the H200's kernels
busy a third of the wall time: bench/results/structured_step_profile_v4_width_nvidia_h200.json); --layers N
serves N such layers (V4 Flash has 43; ~1.9 GB a layer in bf16, written to the temporary folder first: mind the
disk), whose steps the device bounds, as a served model's are, so the engine's pipelining can hide the host's
grammar work behind the step in flight.

Every request decodes exactly max_tokens tokens (ignore_eos). The regex `[a-z ]+` may end, and so may the JSON
object (no property is required: `{}` is a whole answer; a "text" property needs 400 characters), after which
only end-of-sequence is allowed. A counted regex such as `[a-z ]{400,}` costs
llguidance ~0.4-0.6 ms a mask instead (measured once while writing this): large bounded repeats are expensive.
Targets (issue #19): under 50 us of mask time per token per request at batch 64, and no more than 10% of decode
throughput lost.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_report  # noqa: E402

CONSTRAINTS = {
    "regex": {"regex": "[a-z ]+"},
    "json": {"json": {"type": "object", "properties": {"text": {"type": "string", "minLength": 400}}}},
}


def workload(batch: int, max_tokens: int, constraint: dict | None):
    from deepinfer import SamplingParams, StructuredOutputsParams

    wanted = StructuredOutputsParams(**constraint) if constraint else None
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True, structured_outputs=wanted)
        for i in range(batch)
    ]
    return [f"Request {i}: write something." for i in range(batch)], params


def timed(llm, prompts, params) -> tuple[float, list, list[float]]:
    """(seconds, outputs, mask times) of one run."""
    stats = llm.engine.structured_stats
    if stats is not None:
        stats.drain()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, outputs, (stats.drain()[1] if stats is not None else [])


def summary(times: list[float], outputs, masks: list[float], constraint: dict | None) -> dict:
    seconds = statistics.median(times)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    row = {"seconds": seconds, "seconds_per_repeat": times, "tokens": tokens, "tokens_per_s": tokens / seconds}
    if constraint:
        masks = sorted(masks)
        texts = [o.outputs[0].text for o in outputs]
        follows = (
            (lambda t: re.fullmatch(r"[a-z ]*", t))
            if "regex" in constraint
            else (lambda t: t == "{}" or t.startswith('{"'))
        )
        row.update(
            outputs_following_constraint=sum(bool(follows(t)) for t in texts) / len(texts),
            mask_samples=len(masks),
            mask_us_mean=statistics.fmean(masks) * 1e6,
            mask_us_median=masks[len(masks) // 2] * 1e6,
            mask_us_p90=masks[int(len(masks) * 0.9)] * 1e6,
        )
    return row


def run_batch(llm, batch: int, max_tokens: int, repeats: int) -> dict[str, dict]:
    """Each configuration (unconstrained, then each constraint) once as a warm-up (device graphs, grammars,
    caches), then `repeats` rounds of one timed run of each, interleaved so that a drift of the machine's speed
    falls on all of them alike."""
    configs = {"unconstrained": None, **CONSTRAINTS}
    work = {name: workload(batch, max_tokens, c) for name, c in configs.items()}
    for prompts, params in work.values():
        llm.generate(prompts, params, use_tqdm=False)
    times = {name: [] for name in configs}
    last = {}
    for _ in range(repeats):
        for name, (prompts, params) in work.items():
            seconds, outputs, masks = timed(llm, prompts, params)
            times[name].append(seconds)
            previous = last.get(name, (None, []))[1]
            last[name] = (outputs, previous + masks)
    return {name: summary(times[name], *last[name], configs[name]) for name in configs}


def v4_width_config(layers: int = 4) -> dict:
    """gpu_decode.py's V4-width DeepSeek-V4 config with `layers` layers: its 4 layers' attention kinds repeated,
    the first MoE layer hash-routed as there."""
    from _gpu_v4 import CONFIGS

    raw = dict(CONFIGS["v4"][0])
    kinds = raw["layer_types"]
    raw.update(
        num_hidden_layers=layers,
        layer_types=[kinds[i % len(kinds)] for i in range(layers)],
        mlp_layer_types=["hash_moe"] + ["moe"] * (layers - 1),
    )
    return raw


def write_v4_width(folder: Path, device: str, layers: int = 4) -> Path:
    """`v4_width_config(layers)` with random weights (seed 0, drawn in bf16 on `device`) and the demo model's
    tokenizer, as a Hugging Face-format folder."""
    import shutil

    import torch
    from _gpu_v4 import FAMILIES, random_weights
    from safetensors.torch import save_file

    from deepinfer_core.engine.tokenizer import demo_tokenizer_dir

    raw, family = v4_width_config(layers), FAMILIES["v4"]
    weights = random_weights(family, family.parse(raw), torch.device(device), torch.bfloat16, seed=0)
    save_file({name: t.contiguous().cpu() for name, t in weights.items()}, str(folder / "model.safetensors"))
    del weights
    (folder / "config.json").write_text(json.dumps({**raw, "torch_dtype": "bfloat16"}))
    for path in demo_tokenizer_dir().iterdir():
        if path.is_file() and path.suffix != ".py":
            shutil.copy(path, folder / path.name)
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each configuration (the median is kept)")
    parser.add_argument("--model", choices=("demo", "v4-width"), default="demo")
    parser.add_argument("--layers", type=int, default=4, help="--model v4-width's layer count")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    from deepinfer import LLM

    scratch = tempfile.TemporaryDirectory(prefix="structured_overhead_")
    if args.model == "demo":
        llm = LLM(accelerator=args.accelerator, max_num_seqs=64, progress=False)
    else:
        device = "cuda" if args.accelerator != "cpu" else "cpu"
        folder = write_v4_width(Path(scratch.name), device, args.layers)
        llm = LLM(str(folder), accelerator=args.accelerator, dtype="bfloat16", max_num_seqs=64, progress=False)
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        runs = run_batch(llm, batch, args.max_tokens, args.repeats)
        plain = runs["unconstrained"]
        for name in CONSTRAINTS:
            constrained = runs[name]
            row = {
                "batch": batch,
                "constraint": name,
                "unconstrained": plain,
                "constrained": constrained,
                "throughput_lost": 1 - constrained["tokens_per_s"] / plain["tokens_per_s"],
            }
            rows.append(row)
            print(
                f"batch {batch} {name}: {plain['tokens_per_s']:.0f} -> {constrained['tokens_per_s']:.0f} tok/s "
                f"({row['throughput_lost']:+.1%} lost), mask {constrained['mask_us_median']:.0f} us median "
                f"{constrained['mask_us_p90']:.0f} us p90 per token per request",
                flush=True,
            )
    write_report(
        args.out,
        "structured_overhead",
        argv,
        {
            "backend": llm.backend.info.name,
            "device": llm.backend.device.name,
            "model": llm.model_name,
            "layers": args.layers if args.model == "v4-width" else None,
            "max_tokens": args.max_tokens,
            "constraints": CONSTRAINTS,
            "method": f"one LLM ({args.model}); per batch the same prompts and seeds unconstrained and constrained, "
            "ignore_eos; each configuration run once untimed, then --repeats rounds of one timed run of each "
            "(interleaved), the median kept; "
            "mask times are the engine's per constrained row of a step",
            "targets": "mask < 50 us per token per request at batch 64; throughput lost <= 10% (issue #19)",
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
