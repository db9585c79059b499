"""A step in flight: issued to the device, its sampled tokens not yet read back by the host."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_core.engine.request import Request
from deepinfer_core.engine.scheduler import ScheduledStep
from deepinfer_core.engine.transfer import HostCopy
from deepinfer_core.sampling.sampler import SampleOutput

__all__ = ["InFlightTokens", "LaunchedStep"]


@dataclass(frozen=True, slots=True)
class InFlightTokens:
    """The tokens sampled by the step still in flight, where the next step finds them: on the device."""

    token_ids: torch.Tensor  # [S] int64, on the device
    rows: dict[Request, int]  # request -> its row in token_ids


class LaunchedStep:
    """A step whose model and sampler work is issued. The copy of its results to the host starts
    now; `read()` waits for that copy only, not for steps issued after it."""

    def __init__(self, scheduled: ScheduledStep, sampled: list[Request], output: SampleOutput | None) -> None:
        """Made right after the step is issued, before its requests' progress is updated."""
        self.scheduled = scheduled
        self.num_decode_tokens = sum(  # one token past the prompt: decodes (the rest is prefill)
            count == 1 and request.num_computed_tokens >= len(request.prompt_token_ids)
            for request, count in scheduled.requests
        )
        self.sampled = sampled  # the requests that get a token, in the sampler's row order
        self.output = output  # on the device
        tensors = (output.token_ids, output.logprobs, output.top_token_ids, output.top_logprobs) if output else ()
        self._host = HostCopy(tensors)

    def tokens(self) -> InFlightTokens | None:
        """Where the next step finds this step's tokens."""
        if self.output is None:
            return None
        return InFlightTokens(self.output.token_ids, {r: row for row, r in enumerate(self.sampled)})

    def read(self) -> tuple[list[int], list[float], list[list[int]], list[list[float]]]:
        """Per sampled row: token id, its logprob, top token ids, top logprobs (blocks until they are here)."""
        if self.output is None:
            return [], [], [], []
        token_ids, logprobs, top_ids, top_logprobs = (t.tolist() for t in self._host.wait())
        return token_ids, logprobs, top_ids, top_logprobs
