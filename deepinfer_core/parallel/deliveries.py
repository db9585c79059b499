"""What the data-parallel front passed on of each request, so that a request recomputed after a lost rank (it
reports its tokens again from the first) is not passed on twice."""

from __future__ import annotations

from dataclasses import replace

__all__ = ["Deliveries", "DivergedRecomputation"]


class DivergedRecomputation(Exception):
    """A recomputed request's tokens differ from those already passed on."""


class Deliveries:
    """Per request and sample: the tokens and characters passed on so far."""

    def __init__(self) -> None:
        self._passed: dict[str, dict[int, tuple[tuple[int, ...], int]]] = {}

    def forget(self, request_id: str) -> None:
        self._passed.pop(request_id, None)

    def new_part(self, output):
        """`output` less what was passed on before; None when nothing of it is new. Raises DivergedRecomputation
        where a sample's tokens differ from those passed on (the restarted world computes in another order; only
        batch-invariant backends promise the same tokens): two continuations are never spliced."""
        passed = self._passed.setdefault(output.request_id, {})
        samples = []
        for sample in output.outputs:
            tokens, chars = passed.get(sample.index, ((), 0))
            if sample.token_ids[: len(tokens)] != tokens[: len(sample.token_ids)]:
                raise DivergedRecomputation(output.request_id)
            if len(sample.token_ids) <= len(tokens) and sample.finish_reason is None:
                continue
            if len(sample.token_ids) - len(sample.new_token_ids) < len(tokens):  # partly passed on already
                sample = replace(sample, new_token_ids=sample.token_ids[len(tokens) :], new_text=sample.text[chars:])
            passed[sample.index] = (sample.token_ids, chars + len(sample.new_text))
            samples.append(sample)
        if output.finished:
            del self._passed[output.request_id]
        if not samples and not output.finished:
            return None
        return output if len(samples) == len(output.outputs) else replace(output, outputs=samples)
