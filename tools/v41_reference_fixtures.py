"""Regenerate tests/fixtures/deepseek_v41: tiny DeepSeek-V4.1 checkpoints and what the reference computes on them.

The reference is Hugging Face transformers' `models/deepseek_v41/` (main branch; no pip release has it). Its code
is never committed here; only what running it produces is. For each case below this script writes, into
`<out>/<case>/`:

- `model.safetensors`, `config.json`, `generation_config.json`: the reference's own `save_pretrained` output
  (float32) of a randomly initialised tiny model;
- `tokenizer.json`, `tokenizer_config.json`: a small byte-level BPE tokenizer built here (the engram layers hash
  token ids through a tokenizer-derived compressed vocabulary, so a checkpoint with engram layers needs one);
- `reference_logits.safetensors`: logits (float32) and greedy token ids recorded through the reference's cache path;
- `reference.json`: prompts, chunk sizes, greedy tokens, the layer roles, the state_dict key names, the knife-edge
  report (top-k ties, fake-quant values next to a rounding step, greedy margins), the reference's own
  chunked/decode-vs-prefill agreement, versions, and what had to be worked around.

A case whose recording sits on a knife edge (an exact top-k tie, chunked or decode logits that differ from one-shot
prefill, a near-tied greedy choice) makes the script exit non-zero: change that case's seed in
tools/v41_fixture_cases.py. Runs are deterministic (single thread, fixed seeds): a second run writes the same bytes.

Getting the reference files: from https://github.com/huggingface/transformers at commit
0a2080b43eb64e6d448186a4f3f0bc9c618f4797 take `src/transformers/models/deepseek_v41/modeling_deepseek_v41.py` and
`src/transformers/models/deepseek_v41/configuration_deepseek_v41.py` and put them in one folder outside this
repository. Their SHA-256 sums are recorded in every reference.json (and in EXPECTED_SHA256 below); a mismatch is
reported, not refused, so a newer reference can be tried on purpose.

Usage (repository root, the project venv active; transformers 5.24.0, torch CPU):

    python tools/v41_reference_fixtures.py --reference /tmp/v41ref/deepseek_v41 --out tests/fixtures/deepseek_v41

How the reference runs without being installed: a temporary folder gets a `transformers` package made of symlinks
to the installed one, plus a real `models/deepseek_v41/` holding the two reference files; that folder goes first on
sys.path. The installed package is not modified and no bytecode is written.

Two things the reference cannot do on transformers 5.24 are worked around here, not patched:
- `DynamicCache(config=...)` cannot build the reference's cache layer (5.24 passes `config` only to its own
  compressed layer types), so every sequence gets a pre-built `Cache` of `DeepseekV41CSACache` on kv-source layers
  and `DynamicSlidingWindowLayer` elsewhere;
- `use_cache=False` mixes the compressed KV of several kv sources in this reference version, so everything is
  recorded with `use_cache=True` through that cache.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import io
import json
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from v41_fixture_cases import CASES, PROMPT_TEXT, Case, build_tokenizer  # noqa: E402
from v41_fixture_monitors import QuantEdgeMonitor, TopkTieMonitor  # noqa: E402

REFERENCE_COMMIT = "0a2080b43eb64e6d448186a4f3f0bc9c618f4797"
EXPECTED_SHA256 = {
    "modeling_deepseek_v41.py": "b06cef1007cba028030ee3914fa955b1d237c5d9c8498582b2be9e7877099f92",
    "configuration_deepseek_v41.py": "c9a2a19da6caf600c8b5705d97ccd341a37e9718eef78763dd4611031877eb67",
}
SELF_CHECK_LIMIT = 1e-5  # float32 path-to-path noise is ~1e-6; a flipped rounding or selection shows as 1e-3 and up
GREEDY_MARGIN_LIMIT = 5e-4
WORKAROUNDS = [
    "cache: a pre-built transformers Cache of DeepseekV41CSACache (kv-source layers) and "
    "DynamicSlidingWindowLayer(sliding_window) (other layers), because DynamicCache(config=...) in 5.24 does not "
    "pass `config` to the 'shared_compressed_attention' layer type",
    "use_cache=True everywhere: this reference's use_cache=False path concatenates the compressed KV / index keys "
    "of all kv sources",
    "engram: the tokenizer is bound with model.model.bind_tokenizer(tokenizer) (the reference would otherwise "
    "fetch it through config._name_or_path); the n-gram history on the model is reset before each sequence",
    "while recording, torch.Tensor.topk and the reference's _fake_quant_fp8_block/_fake_quant_fp4_block are wrapped "
    "by observers (tools/v41_fixture_monitors.py) that return the original results unchanged",
    "no reference code was modified",
]


def install_overlay(reference: Path, workdir: Path):
    """Make the reference importable as `transformers.models.deepseek_v41`; returns (modeling, configuration)."""
    if "transformers" in sys.modules:
        raise RuntimeError("transformers was imported before the overlay was installed; run this file as a script")
    missing = [name for name in EXPECTED_SHA256 if not (reference / name).is_file()]
    if missing:
        raise SystemExit(f"--reference {reference} lacks {missing}; see this file's docstring for where to get them")
    installed = Path(importlib.util.find_spec("transformers").origin).parent  # finds it without importing it
    package = workdir / "transformers"
    (package / "models").mkdir(parents=True)
    for entry in installed.iterdir():
        if entry.name not in ("models", "__pycache__"):
            (package / entry.name).symlink_to(entry)
    for entry in (installed / "models").iterdir():
        if entry.name not in ("deepseek_v41", "__pycache__"):
            (package / "models" / entry.name).symlink_to(entry)
    target = package / "models" / "deepseek_v41"
    target.mkdir()
    for name in EXPECTED_SHA256:
        shutil.copyfile(reference / name, target / name)
    (target / "__init__.py").write_text("")
    sys.dont_write_bytecode = True
    sys.path.insert(0, str(workdir))
    import transformers

    transformers.logging.disable_progress_bar()
    # Importing an unregistered model makes the auto-docstring checker print errors that do not concern us.
    with contextlib.redirect_stdout(io.StringIO()):
        from transformers.models.deepseek_v41 import configuration_deepseek_v41, modeling_deepseek_v41

    transformers.logging.set_verbosity_error()
    # The reference still calls create_sliding_window_causal_mask(past_key_values=...), deprecated in 5.24.
    warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
    return modeling_deepseek_v41, configuration_deepseek_v41


class ReferenceRunner:
    """Runs one reference model sequence by sequence, each through a fresh pre-built cache."""

    def __init__(self, modeling, model):
        from transformers.cache_utils import Cache, DynamicSlidingWindowLayer

        self.model, self.config = model, model.config
        self._new_layers = lambda: [
            modeling.DeepseekV41CSACache(self.config)
            if kind == "shared_compressed_attention"
            else DynamicSlidingWindowLayer(sliding_window=self.config.sliding_window)
            for kind in self.config.layer_types
        ]
        self._cache_class = Cache

    def start(self):
        hash_state = self.model.model.engram_hash_state
        if hash_state is not None:
            hash_state.history = None  # position-indexed look-back of the previous sequence
        return self._cache_class(layers=self._new_layers())

    @torch.no_grad()
    def step(self, cache, token_ids: list[int]) -> torch.Tensor:
        out = self.model(input_ids=torch.tensor([token_ids]), past_key_values=cache, use_cache=True)
        return out.logits[0].float()  # [T, V]

    def prefill(self, prompt: list[int]) -> torch.Tensor:
        return self.step(self.start(), prompt)

    def chunked(self, prompt: list[int], chunk_sizes: list[int]) -> torch.Tensor:
        cache, rows, start = self.start(), [], 0
        for size in chunk_sizes:
            rows.append(self.step(cache, prompt[start : start + size]))
            start += size
        return torch.cat(rows)

    def decode(self, prompt: list[int], fed: list[int]) -> torch.Tensor:
        cache = self.start()
        self.step(cache, prompt)
        return torch.cat([self.step(cache, [token]) for token in fed])  # [len(fed), V]

    def greedy(self, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
        cache = self.start()
        last, tokens, rows = self.step(cache, prompt)[-1], [], []
        for _ in range(n):
            rows.append(last)
            tokens.append(int(last.argmax()))
            last = self.step(cache, [tokens[-1]])[-1]
        return tokens, torch.stack(rows)


def layer_roles(config) -> list[dict]:
    """What each layer does, derived from the config the same way the reference reads it."""
    roles, cand = [], config.candidate_source_layer_id
    for i in range(config.num_hidden_layers):
        ratio = config.compress_ratios[i]
        role = {"layer": i, "compress_ratio": ratio, "engram": i in config.engram_layer_ids}
        if ratio:
            role["kv_source"] = i in config.kv_source_layer_ids
            role["kv_group"] = max(s for s in config.kv_source_layer_ids if s <= i)
            if i in config.index_source_layer_ids:
                role["index"] = "source, owns keys" if role["kv_source"] else "reindex"
                role["candidates"] = "source" if i == cand else ("constrained" if 0 <= cand < i else "none")
            else:
                role["index"] = "reuses the latest index source's top-k"
        roles.append(role)
    return roles


def build_reference_model(modeling, configuration, case: Case, tokenizer):
    """Random-initialise the case's model with the case seed; zero/one-initialised parameters get random values."""
    kwargs = dict(case.config, vocab_size=len(tokenizer))
    if case.config.get("engram_layer_ids"):
        probe = configuration.DeepseekV41TextConfig(**kwargs)
        layout = modeling.EngramLayout.from_config(probe)
        kwargs["engram_num_embeddings"] = [sum(sum(order) for order in layer) for layer in layout.primes]
        kwargs["engram_compressed_vocab_size"] = modeling.build_compressed_token_map(tokenizer)[1]
    config = configuration.DeepseekV41TextConfig(**kwargs)
    torch.manual_seed(case.seed)
    model = modeling.DeepseekV41ForCausalLM(config).float().eval()
    generator = torch.Generator().manual_seed(case.seed + 1)

    def draw(shape, std, mean=0.0):
        return mean + std * torch.randn(shape, generator=generator)

    with torch.no_grad():
        for name, param in model.named_parameters():
            owner = name.rsplit(".", 2)[-2] if name.count(".") else ""
            if name.endswith("attn_sink"):
                param.copy_(draw(param.shape, 0.5))
            elif name.endswith(("ffn.gate.bias", "ffn.gate.bias_vl")):
                param.copy_(draw(param.shape, 0.2))
            elif name.endswith(("hc_attn_base", "hc_ffn_base")):
                param.copy_(draw(param.shape, 0.5))
            elif name.endswith(("hc_attn_scale", "hc_ffn_scale")):
                param.copy_(draw(param.shape, 0.3, mean=1.0))
            elif name.endswith(("engram.q_weight", "engram.k_weight")):
                param.copy_(draw(param.shape, 0.3, mean=1.0))
            elif owner.endswith("norm") and name.endswith(".weight"):
                param.copy_(draw(param.shape, 0.1, mean=1.0))
    return model


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def save_checkpoint(modeling, configuration, case: Case, folder: Path):
    """Write the case's checkpoint and tokenizer with the reference's own save_pretrained, then load both back;
    the fixtures are recorded with the loaded model, so they describe exactly what is committed."""
    import transformers

    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    tokenizer = build_tokenizer()
    original = build_reference_model(modeling, configuration, case, tokenizer)
    original.save_pretrained(folder)
    tokenizer.save_pretrained(folder)

    config = configuration.DeepseekV41TextConfig.from_pretrained(folder)
    model = modeling.DeepseekV41ForCausalLM.from_pretrained(folder, config=config, dtype=torch.float32).eval()
    loaded = model.state_dict()
    for key, tensor in original.state_dict().items():
        if not torch.equal(tensor, loaded[key]):
            raise RuntimeError(f"{case.name}: {key} changed in the save/load round trip")
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    if config.engram_layer_ids:
        model.model.bind_tokenizer(tokenizer)
    return model, tokenizer


def record(runner: ReferenceRunner, case: Case, prompts, decode_prompt, decode_fed) -> tuple[dict, dict]:
    """All recorded tensors (name -> tensor) and the numbers describing them."""
    tensors, greedy_tokens, margins = {}, [], []
    for i, prompt in enumerate(prompts):
        tensors[f"prefill.{i}"] = runner.prefill(prompt)
    tensors["chunked"] = runner.chunked(prompts[case.chunked_prompt], list(case.chunk_sizes))
    tensors["decode"] = runner.decode(decode_prompt, decode_fed)
    for i, prompt in enumerate(prompts):
        tokens, logits = runner.greedy(prompt, case.greedy_tokens)
        greedy_tokens.append(tokens)
        tensors[f"greedy.{i}.logits"], tensors[f"greedy.{i}.tokens"] = logits, torch.tensor(tokens)
        top2 = logits.topk(2, dim=-1).values
        margins.append(float((top2[:, 0] - top2[:, 1]).min()))
    # The reference against itself: chunking and single-token decode must reproduce one-shot prefill.
    oneshot = runner.prefill(decode_prompt + decode_fed)[len(decode_prompt) :]
    chunked_diff = tensors["chunked"] - tensors[f"prefill.{case.chunked_prompt}"]
    stats = {
        "greedy_tokens": greedy_tokens,
        "min_greedy_margin": min(margins),
        "self_checks": {
            "chunked_vs_prefill_max_abs_diff": float(chunked_diff.abs().max()),
            "decode_vs_prefill_max_abs_diff": float((tensors["decode"] - oneshot).abs().max()),
        },
    }
    return {name: tensor.contiguous() for name, tensor in tensors.items()}, stats


def knife_edges(description: dict) -> list[str]:
    """Reasons this case's fixtures could not be matched by an independent implementation; empty when fine."""
    problems = []
    if description["topk_ties"]["any_exact_tie"]:
        problems.append("an exact top-k tie decides a selection")
    if max(description["self_checks"].values()) > SELF_CHECK_LIMIT:
        problems.append(f"chunked or decode logits differ from one-shot prefill by more than {SELF_CHECK_LIMIT}")
    if description["greedy"]["min_top1_top2_margin"] < GREEDY_MARGIN_LIMIT:
        problems.append(f"a greedy choice is decided by less than {GREEDY_MARGIN_LIMIT}")
    return problems


def record_case(modeling, configuration, case: Case, out: Path, reference: Path) -> dict:
    import safetensors.torch
    import transformers

    folder = out / case.name
    model, tokenizer = save_checkpoint(modeling, configuration, case, folder)
    stream = tokenizer.encode(PROMPT_TEXT * 4, add_special_tokens=False)
    prompts = [stream[offset : offset + length] for offset, length in zip(case.prompt_offsets, case.prompt_lengths)]
    decode_seq = stream[case.decode_offset : case.decode_offset + case.decode_prefill + case.decode_steps]
    decode_prompt, decode_fed = decode_seq[: case.decode_prefill], decode_seq[case.decode_prefill :]
    with TopkTieMonitor(modeling) as ties, QuantEdgeMonitor(modeling) as edges:
        tensors, stats = record(ReferenceRunner(modeling, model), case, prompts, decode_prompt, decode_fed)
    metadata = {"reference_commit": REFERENCE_COMMIT}
    safetensors.torch.save_file(tensors, folder / "reference_logits.safetensors", metadata=metadata)

    state = safetensors.torch.load_file(folder / "model.safetensors")
    description = {
        "case": case.name,
        "covers": case.covers,
        "seed": case.seed,
        "reference": {
            "repository": "huggingface/transformers",
            "commit": REFERENCE_COMMIT,
            "files": {f"src/transformers/models/deepseek_v41/{n}": _sha256(reference / n) for n in EXPECTED_SHA256},
        },
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "workarounds": WORKAROUNDS,
        "dtype": "float32",
        "layers": layer_roles(model.config),
        "tokenizer": {
            "len": len(tokenizer),
            "engram_compressed_vocab_size": modeling.build_compressed_token_map(tokenizer)[1],
        },
        "state_dict": {key: {"shape": list(t.shape), "dtype": str(t.dtype)[6:]} for key, t in state.items()},
        "prefill": {"prompts": prompts, "logits": [f"prefill.{i}" for i in range(len(prompts))]},
        "chunked": {"prompt_index": case.chunked_prompt, "chunk_sizes": list(case.chunk_sizes), "logits": "chunked"},
        "decode": {
            "prompt": decode_prompt,
            "fed_tokens": decode_fed,
            "logits": "decode",
            "note": "row i is the logits after feeding fed_tokens[i] one token at a time after prefilling `prompt`",
        },
        "greedy": {
            "tokens": stats["greedy_tokens"],
            "logits": [f"greedy.{i}.logits" for i in range(len(prompts))],
            "token_ids": [f"greedy.{i}.tokens" for i in range(len(prompts))],
            "note": "row j of greedy.i.logits chose tokens[i][j]; the prompt is prefill.prompts[i]",
            "min_top1_top2_margin": stats["min_greedy_margin"],
        },
        "topk_ties": ties.report(),
        "quant_edges": edges.report(),
        "self_checks": stats["self_checks"],
    }
    description["knife_edges"] = knife_edges(description)
    (folder / "reference.json").write_text(json.dumps(description, indent=1) + "\n")
    return description


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference", type=Path, required=True, help="folder with the two reference files")
    parser.add_argument("--out", type=Path, required=True, help="fixture folder, e.g. tests/fixtures/deepseek_v41")
    parser.add_argument("--case", action="append", help="only these cases (default: all)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for name, expected in EXPECTED_SHA256.items():
        if (args.reference / name).is_file() and _sha256(args.reference / name) != expected:
            print(f"warning: {name} differs from the commit {REFERENCE_COMMIT[:10]} version these fixtures expect")
    failed = False
    with tempfile.TemporaryDirectory(prefix="v41overlay-") as workdir:
        modeling, configuration = install_overlay(args.reference, Path(workdir))
        for case in CASES:
            if args.case and case.name not in args.case:
                continue
            result = record_case(modeling, configuration, case, args.out, args.reference)
            size = sum(p.stat().st_size for p in (args.out / case.name).iterdir())
            verdict = "; ".join(result["knife_edges"]) or "no knife edges"
            print(f"{case.name}: {size / 1024:.0f} KiB, {verdict}, self checks {result['self_checks']}")
            failed |= bool(result["knife_edges"])
    if failed:
        raise SystemExit("some fixtures sit on a knife edge (see above): change that case's seed or config")


if __name__ == "__main__":
    main()
