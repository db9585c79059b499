"""How to fill a step's structured-output masks (issue #19): 64 sequences walking one grammar (copies of a started
matcher, as the engine makes them, or matchers built anew), each step's masks filled one row after another
through llguidance's torch helper (Python per row) and in one call to its executor with 1-12 threads; and the
grammars fed one token each (one call per row, or the executor's consume_token_par). The methods run in a
shuffled order each step, over the same states.

    python bench/grammar_fill_modes.py --out bench/results/grammar_fill_modes_nvidia_h200.json

The tokens fed are drawn from each row's mask (seeded), so every state is one the grammar allows.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_report  # noqa: E402

CONSTRAINTS = {
    "regex": {"regex": "[a-z ]+"},
    "json": {"json": {"type": "object", "properties": {"text": {"type": "string", "minLength": 400}}}},
}
THREADS = (1, 2, 4, 8, 12)


def allowed_token(row, vocab_size: int, rng: random.Random) -> int:
    """A token the row's mask allows (from up to 8 of its non-zero words)."""
    words = row.nonzero().flatten().tolist()
    choices = []
    for word in rng.sample(words, min(8, len(words))):
        bits = int(row[word]) & 0xFFFFFFFF
        choices += [word * 32 + b for b in range(32) if bits >> b & 1 and word * 32 + b < vocab_size]
    return rng.choice(choices)


def measure(compiler, params, matchers: str, batch: int, steps: int) -> dict:
    import llguidance
    import torch

    from deepinfer_core.structured.grammars import GrammarState

    if matchers == "copies":
        states = [compiler.state(params) for _ in range(batch)]
    else:
        grammar = compiler.grammar(params)
        states = [
            GrammarState(llguidance.LLMatcher(compiler.tokenizer, grammar), compiler.vocab_size) for _ in range(batch)
        ]
    mask = torch.full((batch, states[0].width), -1, dtype=torch.int32)
    executors = {n: llguidance.LLExecutor(num_threads=n) for n in THREADS}
    pairs = [(state._matcher, k) for k, state in enumerate(states)]
    rng = random.Random(0)
    times: dict[str, list[float]] = {"per_row": [], **{f"executor_{n}": [] for n in THREADS}}
    times.update(consume_per_row=[], consume_executor_1=[])
    for step in range(steps):
        methods = ["per_row", *THREADS]
        rng.shuffle(methods)
        for method in methods:
            start = time.perf_counter()
            if method == "per_row":
                for k, state in enumerate(states):
                    state.fill(mask, k)
            else:
                executors[method].unsafe_compute_mask_ptr(pairs, mask.data_ptr(), mask.shape[1] * 4, batch)
            times["per_row" if method == "per_row" else f"executor_{method}"].append(time.perf_counter() - start)
        tokens = [allowed_token(mask[k], compiler.vocab_size, rng) for k in range(batch)]
        start = time.perf_counter()
        if step % 2 == 0:
            for state, token in zip(states, tokens):
                state.accept(token)
            times["consume_per_row"].append(time.perf_counter() - start)
        else:
            executors[1].consume_token_par([(state._matcher, token) for state, token in zip(states, tokens)])
            times["consume_executor_1"].append(time.perf_counter() - start)
    return {
        name: {"ms_median": statistics.median(values) * 1e3, "ms_mean": statistics.fmean(values) * 1e3}
        for name, values in times.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    from deepinfer_core.engine.tokenizer import Tokenizer, demo_tokenizer_dir
    from deepinfer_core.structured.grammars import GrammarCompiler
    from deepinfer_core.structured.params import StructuredOutputsParams

    tokenizer = Tokenizer.from_dir(demo_tokenizer_dir())
    compiler = GrammarCompiler(tokenizer.to_json(), tokenizer.vocab_size, [tokenizer.eos_token_id])
    rows = []
    for name, constraint in CONSTRAINTS.items():
        for matchers in ("copies", "fresh"):
            row = {"constraint": name, "matchers": matchers}
            row.update(measure(compiler, StructuredOutputsParams(**constraint), matchers, args.batch, args.steps))
            rows.append(row)
            print(name, matchers, {k: round(v["ms_median"], 3) for k, v in row.items() if isinstance(v, dict)})
    write_report(
        args.out,
        "grammar_fill_modes",
        argv,
        {
            "batch": args.batch,
            "steps": args.steps,
            "constraints": CONSTRAINTS,
            "method": "per step of `batch` sequences: each fill method once in a shuffled order over the same states "
            "(ms for the whole batch), then one token each fed (per row on even steps, the executor's "
            "consume_token_par on odd ones); median and mean over the steps",
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
