"""The systems offline_throughput.py times (DeepInfer's offline API, transformers' generate) and the timing loop."""

from __future__ import annotations

import time
from pathlib import Path

import torch


class DeepInferSystem:
    """DeepInfer's offline API on the reference backend: every prompt in one `generate` call."""

    name = "deepinfer"

    def __init__(
        self, checkpoint: Path, *, block_size: int | None, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        from deepinfer_core.engine.llm import LLM

        t0 = time.perf_counter()
        self.llm = LLM(
            model=checkpoint,
            accelerator="cpu",
            dtype="float32",
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            progress=False,
        )
        self.load_seconds = time.perf_counter() - t0
        self.info = {
            "system": self.name,
            "description": (
                "DeepInfer LLM.generate, reference backend (accelerator=cpu), float32, all prompts in one call"
            ),
            "backend": self.llm.backend.info.name,
            "block_size": self.llm.backend.kv_layout.block_size,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "prefix_caching": "on (engine default); every repeat uses fresh prompts, so no hits are expected",
            "load_seconds": self.load_seconds,
        }

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], dict]:
        from deepinfer_core.sampling.params import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        steps_before = getattr(self.llm.engine, "_step", None)  # a private counter; None if it goes away
        outputs = self.llm.generate(prompts, params)
        steps_after = getattr(self.llm.engine, "_step", None)
        extra = {
            "engine_steps": None if steps_before is None else steps_after - steps_before,
            "prefix_cached_tokens": sum(o.num_cached_tokens for o in outputs),
            "finish_reasons": sorted({o.outputs[0].finish_reason for o in outputs}),
        }
        return [list(o.outputs[0].token_ids) for o in outputs], extra


class HFSystem:
    """transformers' DeepseekV3ForCausalLM.generate, batched the way a user would (left padding + mask)."""

    def __init__(self, model, load_seconds: float, batch_size: int) -> None:
        self.model, self.batch_size, self.name = model, batch_size, f"hf_batch{batch_size}"
        self.info = {
            "system": self.name,
            "description": (
                f"transformers DeepseekV3ForCausalLM.generate, float32, eager attention, batch {batch_size}, "
                "left padding + attention_mask, do_sample=False, min_new_tokens=max_new_tokens, eos_token_id=None"
            ),
            "batch_size": batch_size,
            "load_seconds": load_seconds,
        }

    def _batch(self, prompts: list[list[int]], max_new_tokens: int, pad_id: int = 0) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [B, width], left padded
        mask = torch.zeros((len(prompts), width), dtype=torch.long)  # [B, width]
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                # no EOS: decoding never stops early and no EOS logit gets masked, i.e. DeepInfer's ignore_eos
                eos_token_id=None,
                pad_token_id=pad_id,
                use_cache=True,
            )
        return [row[width:].tolist() for row in out]

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], dict]:
        tokens: list[list[int]] = []
        for start in range(0, len(prompts), self.batch_size):
            tokens += self._batch(prompts[start : start + self.batch_size], max_tokens)
        return tokens, {"forward_steps": max_tokens * -(-len(prompts) // self.batch_size)}


def load_hf(checkpoint: Path):
    """transformers' model in float32 with eager attention, and the seconds it took to load."""
    from transformers import DeepseekV3ForCausalLM

    t0 = time.perf_counter()
    model = DeepseekV3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager").eval()
    return model, time.perf_counter() - t0


def time_interleaved(
    systems: list, warmup: list[list[int]], prompt_sets: list[list[list[int]]], max_new_tokens: int
) -> tuple[dict[str, list[float]], dict[str, list[list[int]]], dict[str, list[dict]]]:
    """Warm every system up, then time each on every prompt set, systems interleaved within a repeat.

    Returns, by system name: seconds per repeat, generated token ids of all repeats (concatenated),
    and each repeat's extra counters.
    """
    for system in systems:
        system.generate(warmup, 4)
    seconds: dict[str, list[float]] = {s.name: [] for s in systems}
    tokens: dict[str, list[list[int]]] = {s.name: [] for s in systems}
    extras: dict[str, list[dict]] = {s.name: [] for s in systems}
    for r, prompts in enumerate(prompt_sets):
        for system in systems:
            t0 = time.perf_counter()
            out, extra = system.generate(prompts, max_new_tokens)
            seconds[system.name].append(time.perf_counter() - t0)
            tokens[system.name] += out
            extras[system.name].append(extra)
        print(
            f"repeat {r + 1}/{len(prompt_sets)}: " + ", ".join(f"{n} {v[-1]:.2f} s" for n, v in seconds.items()),
            flush=True,
        )
    return seconds, tokens, extras
