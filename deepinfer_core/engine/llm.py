"""The offline API: `LLM(model=..., accelerator=...).generate(prompts, SamplingParams)`."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from deepinfer_core.backend.registry import discover
from deepinfer_core.backend.resolve import ResolvedBackend, resolve_backend
from deepinfer_core.backend.selection import requested_accelerator, select_backend
from deepinfer_core.engine.engine import Engine, EngineConfig
from deepinfer_core.engine.request import RequestOutput
from deepinfer_core.engine.scheduler import SchedulerConfig
from deepinfer_core.engine.tokenizer import Tokenizer, demo_tokenizer_dir
from deepinfer_core.errors import DeepInferError
from deepinfer_core.model import load_model, model_registry
from deepinfer_core.model.deepseek_v4 import UnsupportedModelError
from deepinfer_core.model.demo import DEMO_NAME, demo_model
from deepinfer_core.sampling.params import SamplingParams

__all__ = ["LLM"]

log = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

Prompt = str | Sequence[int]


def _load_on_first_able(discovery, accelerator: str | None, resolve, load):
    """(backend, model) on the requested backend; under `auto`, on the first available backend (in
    priority order) that can run the model, saying which ones could not and why."""
    if requested_accelerator(accelerator) != "auto":
        backend = resolve(select_backend(discovery, accelerator))
        return backend, load(backend)
    # select_backend raises, with the reason, if no backend is available
    *others, last = [entry for entry in discovery.backends if entry.available] or [select_backend(discovery, "auto")]
    for entry in others:
        backend = resolve(entry)
        try:
            return backend, load(backend)
        except UnsupportedModelError as err:
            log.warning("%s; trying the next available backend", err)
    backend = resolve(last)
    return backend, load(backend)


class LLM:
    """Load a model on the selected backend and generate from it.

    model: a Hugging Face-format checkpoint folder, or None for the embedded demo model (random weights).
    accelerator: backend name, alias or "auto" (default: $DEEPINFER_ACCELERATOR, else auto).
    backend: an already resolved backend to run on instead (accelerator, dtype and block_size are then
        the backend's); the conformance suite uses this to run the engine on the backend under test.
    async_scheduling: plan step N+1 while the device runs step N (None: where the backend supports it).
    batch_invariant: run the backend's batch-invariant mode (a request's logits do not depend on the rest
        of the batch; an error if the backend has no such mode).
    graph_batch_size: decode steps of up to this many sequences replay device graphs where the backend
        can capture them (0: always run eagerly).
    """

    def __init__(
        self,
        model: str | Path | None = None,
        accelerator: str | None = None,
        dtype: str = "float32",
        block_size: int | None = None,
        num_kv_blocks: int | None = None,
        kv_cache_memory_bytes: int = 1 << 30,
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        async_scheduling: bool | None = None,
        batch_invariant: bool = False,
        graph_batch_size: int = 256,
        progress: bool = True,
        backend: ResolvedBackend | None = None,
    ) -> None:
        if dtype not in _DTYPES:
            raise DeepInferError(f"dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
        discovery = discover()
        registry = model_registry(discovery.plugin_manager)

        def load(on: ResolvedBackend):
            if model is None:
                return demo_model(on)
            return load_model(Path(model), on, registry, progress)

        if backend is not None:
            self.backend, self.model = backend, load(backend)
        else:
            resolve = functools.partial(
                resolve_backend, dtype=_DTYPES[dtype], block_size=block_size, batch_invariant=batch_invariant
            )
            self.backend, self.model = _load_on_first_able(discovery, accelerator, resolve, load)
        if model is None:
            log.warning(
                "no --model given: serving the embedded demo model (DeepSeek-V4 architecture with "
                "deterministic RANDOM weights; its output is meaningless)"
            )
            self.model_name = DEMO_NAME
            self.tokenizer_dir: Path | None = demo_tokenizer_dir()
        else:
            path = Path(model)
            self.model_name = path.name
            self.tokenizer_dir = path if (path / "tokenizer.json").is_file() else None
        self.tokenizer = Tokenizer.from_dir(self.tokenizer_dir) if self.tokenizer_dir else None
        hook = discovery.plugin_manager.hook
        processors = [p for found in hook.deepinfer_logits_processors(model_name=self.model_name) for p in found]
        observers = [o for found in hook.deepinfer_observers() for o in found]
        config = EngineConfig(
            num_kv_blocks=num_kv_blocks,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            async_scheduling=async_scheduling,
            graph_batch_size=graph_batch_size,
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
        )
        self.engine = Engine(self.model, self.backend, self.tokenizer, config, processors, observers)
        self._next_id = 0

    def _add(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None):
        single = isinstance(prompts, str) or (bool(prompts) and isinstance(prompts[0], int))
        batch = [prompts] if single else list(prompts)
        params = params or SamplingParams()
        per_prompt = [params] * len(batch) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(batch):
            raise DeepInferError(f"{len(batch)} prompts but {len(per_prompt)} sampling parameter sets")
        ids = []
        try:
            for prompt, p in zip(batch, per_prompt):
                request_id = str(self._next_id)
                self._next_id += 1
                self.engine.add_request(request_id, prompt, p)
                ids.append(request_id)
        except DeepInferError:
            for request_id in ids:  # all of the batch or none of it
                self.engine.abort(request_id)
            raise
        return ids

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order."""
        ids = self._add(prompts, sampling_params)
        finished: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
        return [finished[i] for i in ids]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Generate for one prompt, yielding an output (with its text delta) after every token."""
        [request_id] = self._add(prompt, sampling_params)
        while self.engine.has_unfinished():
            for output in self.engine.step():
                if output.request_id == request_id:
                    yield output
