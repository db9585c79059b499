"""Per-request sampling parameters, validated where they are made (bad values are the user's to fix)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SamplingParams"]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """What a request asks of the sampler and of stopping; OpenAI / vLLM meanings.

    temperature 0 means greedy. top_k 0 (or -1) and top_p 1 and min_p 0 switch those filters off.
    seed None means the engine draws one when the request arrives, so every request is sampled with
    counter-based noise and its tokens never depend on the rest of the batch.
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

    def __post_init__(self) -> None:
        problems = []
        if not self.temperature >= 0:
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < -1:
            problems.append(f"top_k must be -1, 0 (off) or a positive count, got {self.top_k}")
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
        if problems:
            raise ValueError("invalid sampling parameters: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
