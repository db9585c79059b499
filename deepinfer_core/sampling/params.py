"""Per-request sampling parameters, validated where they are made (bad values are the user's to fix)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from deepinfer_core.structured.params import StructuredOutputsParams

__all__ = ["SamplingParams"]

_GOLDEN = 0x9E3779B97F4A7C15  # spreads the seeds of a request's sibling samples over the 64-bit range


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """What a request asks of the sampler and of stopping; OpenAI / vLLM meanings.

    temperature 0 means greedy. top_k 0 (or -1) and top_p 1 and min_p 0 switch those filters off.
    seed None means the engine draws one when the request arrives, so every request is sampled with
    counter-based noise and its tokens never depend on the rest of the batch.
    n / best_of: return n samples of the prompt; with best_of, draw best_of and keep the n with the
    highest cumulative logprob (vLLM's meaning). The engine runs each sample as its own sequence
    (`fan_out`); the prompt's KV is shared through the prefix cache.
    min_tokens: end-of-sequence, stop token ids and stop strings cannot end the output before this many
    tokens. skip_special_tokens: leave special tokens out of the text (vLLM's default, True).
    prompt_logprobs: the logprob of every prompt token after the first, and this many top alternatives.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per token (0: only the chosen one)
    n: int = 1
    best_of: int | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None  # vLLM's: json / regex / choice / grammar

    def __post_init__(self) -> None:
        problems = []
        if not self.temperature >= 0:
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if not -1 <= self.top_k < 2**31:
            problems.append(f"top_k must be -1, 0 (off) or a positive count below 2**31, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            problems.append(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0:
            problems.append(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            problems.append(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            problems.append(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            problems.append(f"seed must be in [0, 2**64), got {self.seed}")
        if self.max_tokens < 1:
            problems.append(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            problems.append(f"logprobs must be in [0, 20], got {self.logprobs}")
        if any(not s for s in self.stop):
            problems.append("stop strings must not be empty")
        if self.n < 1:
            problems.append(f"n must be >= 1, got {self.n}")
        if self.best_of is not None and self.best_of < self.n:
            problems.append(f"best_of must be >= n ({self.n}), got {self.best_of}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            problems.append(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            problems.append(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            problems.append(
                f"structured_outputs must be a StructuredOutputsParams, got {type(self.structured_outputs)}"
            )
        if problems:
            raise ValueError("invalid sampling parameters: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def num_samples(self) -> int:
        """Sequences the request runs: best_of when given, else n."""
        return self.best_of or self.n

    def fan_out(self) -> list[SamplingParams]:
        """One single-sample parameter set per sequence of this request. Sample 0 keeps the seed, so n=1
        is unchanged; the others get seeds derived from it (None stays None: the engine draws each)."""

        def seed_of(i: int) -> int | None:
            return None if self.seed is None else (self.seed + i * _GOLDEN) % 2**64

        return [replace(self, n=1, best_of=None, seed=seed_of(i)) for i in range(self.num_samples)]
