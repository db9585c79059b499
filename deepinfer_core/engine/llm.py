"""The offline API, as vLLM spells it: `LLM(model=...).generate(prompts, SamplingParams)` and `LLM.chat(messages)`."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from tqdm import tqdm

from deepinfer_core.backend.registry import discover
from deepinfer_core.backend.resolve import ResolvedBackend, resolve_backend
from deepinfer_core.backend.selection import requested_accelerator, select_backend
from deepinfer_core.engine.dtypes import KV_DTYPE_NAMES, check_kv_cache_dtype, choose_dtype, parse_dtype
from deepinfer_core.engine.engine import Engine, EngineConfig
from deepinfer_core.engine.hub import TOKENIZER_FILES, resolve_location
from deepinfer_core.engine.limits import at_least_one, context_length, gib_bytes
from deepinfer_core.engine.memory import check_utilization, kv_budget_from_utilization, model_bytes
from deepinfer_core.engine.prompts import ChatRenderer, PromptType, normalize_conversations, normalize_prompts
from deepinfer_core.engine.request import FailedRequest, RequestOutput
from deepinfer_core.engine.scheduler import SchedulerConfig
from deepinfer_core.engine.speculative import SpeculativeConfig
from deepinfer_core.engine.tokenizer import Tokenizer, demo_tokenizer_dir
from deepinfer_core.errors import DeepInferError
from deepinfer_core.model import load_drafter, load_model, model_registry
from deepinfer_core.model.deepseek_v4 import UnsupportedModelError
from deepinfer_core.model.demo import DEMO_CONFIG, DEMO_NAME, demo_model
from deepinfer_core.model.loader import read_config
from deepinfer_core.model.v41_engram import check_engram_placement
from deepinfer_core.sampling.params import SamplingParams

__all__ = ["LLM"]

log = logging.getLogger(__name__)
DEFAULT_KV_CACHE_BYTES = 1 << 30

Params = SamplingParams | Sequence[SamplingParams] | None


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
    """Load a model on the selected backend and generate from it (vLLM's `LLM`).

    model: a Hugging Face-format checkpoint folder, a Hugging Face Hub id ("org/name", fetched into the Hub
        cache; HF_HUB_OFFLINE=1 uses the cache only), or None for the embedded demo model (random weights).
    tokenizer: a folder or Hub id holding tokenizer.json to use instead of the model's.
    revision / download_dir: the Hub revision of the model, and the cache folder downloads go to.
    accelerator: backend name, alias or "auto" (default: $DEEPINFER_ACCELERATOR, else auto).
    dtype: "auto" (bfloat16 on an accelerator for a 16-bit or FP8 checkpoint, else the checkpoint's dtype:
        float32 for the demo model), or float32 / bfloat16 / float16 (and vLLM's float, half, ...).
    seed: seeds the per-request seeds the engine draws for requests without one, so runs repeat.
    kv_cache_dtype: "auto" (the model dtype) or a dtype the backend stores KV in.
    gpu_memory_utilization: share (0, 1] of the device's memory for weights and KV cache; the KV cache gets
        what the weights leave. kv_cache_memory_bytes (default 1 GiB) or num_kv_blocks, when given, win.
    max_model_len: the context in tokens (default: the model's max_position_embeddings; more is refused).
    max_num_seqs / max_num_batched_tokens: sequences and tokens in one step; any value from 1 works (prefills
        are chunked to fit the token budget). Limits below 1 are refused before anything loads.
    backend: an already resolved backend to run on instead (accelerator, dtype and block_size are then
        the backend's); the conformance suite uses this to run the engine on the backend under test.
    async_scheduling: plan step N+1 while the device runs step N (None: where the backend supports it).
    batch_invariant: run the backend's batch-invariant mode (a request's logits do not depend on the rest
        of the batch; an error if the backend has no such mode).
    graph_batch_size: decode steps of up to this many sequences replay device graphs where the backend
        can capture them (0: always run eagerly).
    engram_placement: where DeepSeek-V4.1's Engram tables live: "host" (host memory; each step's rows are
        copied to the device), "device", or "auto" (the host when the tables would take more than a tenth
        of the device's memory; the device on a cpu backend, whose device is host memory). Other models
        ignore it.
    prefix_replay: what a prefix-cache hit recomputes to rebuild DeepSeek-V4/V4.1's sliding windows and
        per-sequence states: "exact" (every token they depend on: the layers x (window - 1) tokens before the
        hit's end; outputs equal a run without the hit) or "bounded" (only the last 128, as DeepSeek's own
        engine: faster, and the logits just past the hit differ from a run without it). Other models ignore it.
    window_snapshot_gb: host memory (GiB) for snapshots of DeepSeek-V4/V4.1's windows and per-sequence states
        at block boundaries: a prefix hit at a snapshotted boundary restores them exactly and replays nothing
        (least recently used first out; 0: none, every hit replays). Other models ignore it.
    speculative_config: vLLM's speculative config, a dict or its JSON ({"method": "ngram",
        "num_speculative_tokens": 4, ...}; engine/speculative.py): decode steps verify drafted tokens and may
        yield several, with the same output as without it. None: off.
    progress: progress bars while the model downloads, is built or loads.
    data_parallel_size: engine ranks, one process each (parallel/data_parallel.py): each runs attention for its
        own requests. enable_expert_parallel: the ranks split the routed experts between them and every MoE
        layer dispatches and combines over torch.distributed (else every rank holds all of them). With more
        than one rank, or expert parallelism (one rank: an expert-parallel world of one, its MoE traffic through
        the backend's collectives), this process loads no model (`model` and `backend` are None) and feeds the
        ranks.
    enable_eplb / eplb_config: re-place the experts (with redundant copies) between the ranks from their recent
        loads while serving (parallel/eplb_runtime.py; vLLM's names: {"window_size", "step_interval",
        "num_redundant_experts"}).
    data_parallel_size_local / data_parallel_address / data_parallel_rpc_port: ranks on several nodes (vLLM's
        names; parallel/nodes.py): this node runs ranks 0 .. data_parallel_size_local - 1 and serves the others'
        queues at address:rpc_port (default 29550), which `deepinfer serve --headless` on each other node joins.
    expert_parallel_rank: (rank, world size) of an engine rank whose torch.distributed world is up, or (rank,
        world size, device index) where its device is not the rank's (the ranks data_parallel_size starts pass it;
        after a lost rank the survivors keep their devices); None: one rank, every expert here.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        tokenizer: str | Path | None = None,
        revision: str | None = None,
        download_dir: str | Path | None = None,
        accelerator: str | None = None,
        dtype: str | torch.dtype = "auto",
        seed: int | None = None,
        kv_cache_dtype: str | torch.dtype = "auto",
        gpu_memory_utilization: float | None = None,
        block_size: int | None = None,
        num_kv_blocks: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        prefix_replay: Literal["exact", "bounded"] = "exact",
        window_snapshot_gb: float = 4.0,
        async_scheduling: bool | None = None,
        batch_invariant: bool = False,
        graph_batch_size: int = 256,
        engram_placement: str = "auto",
        speculative_config: dict | str | None = None,
        progress: bool = True,
        backend: ResolvedBackend | None = None,
        data_parallel_size: int = 1,
        enable_expert_parallel: bool = False,
        enable_eplb: bool = False,
        eplb_config: dict | None = None,
        expert_parallel_rank: tuple[int, ...] | None = None,
        data_parallel_size_local: int | None = None,
        data_parallel_address: str = "127.0.0.1",
        data_parallel_rpc_port: int | None = None,
    ) -> None:
        if enable_eplb and not (data_parallel_size > 1 and enable_expert_parallel):
            raise DeepInferError("enable_eplb balances experts between ranks: give data_parallel_size > 1 and "
                                 "enable_expert_parallel=True")  # fmt: skip
        if data_parallel_size != 1 or enable_expert_parallel or data_parallel_size_local is not None:
            self._start_ranks(locals())
            return
        requested = parse_dtype(dtype)
        parse_dtype(kv_cache_dtype, "kv_cache_dtype", KV_DTYPE_NAMES)
        check_utilization(gpu_memory_utilization)
        at_least_one("block_size", block_size)
        check_engram_placement(engram_placement)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64):
            raise DeepInferError(f"seed must be an integer in [0, 2**64), got {seed!r}")
        config = EngineConfig(  # checks the engine's limits before anything is downloaded or loaded
            num_kv_blocks=num_kv_blocks,
            kv_cache_memory_bytes=DEFAULT_KV_CACHE_BYTES if kv_cache_memory_bytes is None else kv_cache_memory_bytes,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            prefix_replay=prefix_replay,
            window_snapshot_bytes=gib_bytes("window_snapshot_gb", window_snapshot_gb),
            async_scheduling=async_scheduling,
            graph_batch_size=graph_batch_size,
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
            seed=seed,
            speculative=SpeculativeConfig.parse(speculative_config),
        )
        path, from_hub = (
            (None, False)
            if model is None
            else resolve_location(model, what="model", revision=revision, download_dir=download_dir, progress=progress)
        )
        raw_config = DEMO_CONFIG if path is None else read_config(path)
        if raw_config.get("max_position_embeddings") is not None:  # the engine checks the built model's again
            context_length(max_model_len, int(raw_config["max_position_embeddings"]))
        discovery = discover()
        registry = model_registry(discovery.plugin_manager, engram_placement)

        def load(on: ResolvedBackend):
            return demo_model(on, progress) if path is None else load_model(path, on, registry, progress)

        def resolve(entry) -> ResolvedBackend:
            chosen = choose_dtype(requested, entry.info, entry.capabilities, raw_config)
            check_kv_cache_dtype(kv_cache_dtype, entry.info, entry.capabilities, chosen)
            rank, world, *device = expert_parallel_rank or (0, 1)
            return resolve_backend(
                entry, dtype=chosen, block_size=block_size, batch_invariant=batch_invariant, world_size=world,
                rank=rank, device_index=device[0] if device else rank,
            )  # fmt: skip

        if backend is not None:
            check_kv_cache_dtype(kv_cache_dtype, backend.info, backend.capabilities, backend.dtype)
            self.backend, self.model = backend, load(backend)
        else:
            self.backend, self.model = _load_on_first_able(discovery, accelerator, resolve, load)
        if path is None:
            log.warning(
                "no --model given: serving the embedded demo model (DeepSeek-V4 architecture with "
                "deterministic RANDOM weights; its output is meaningless)"
            )
        self.model_name = DEMO_NAME if path is None else str(model) if from_hub else path.name
        self.model_path = path  # the checkpoint folder (None: the demo model)
        self.tokenizer_dir = self._tokenizer_dir(path, tokenizer, download_dir, progress)
        self.tokenizer = Tokenizer.from_dir(self.tokenizer_dir) if self.tokenizer_dir else None
        hook = discovery.plugin_manager.hook
        processors = [p for found in hook.deepinfer_logits_processors(model_name=self.model_name) for p in found]
        observers = [o for found in hook.deepinfer_observers() for o in found]
        budget = self._kv_budget(num_kv_blocks, kv_cache_memory_bytes, gpu_memory_utilization)
        config = dataclasses.replace(config, kv_cache_memory_bytes=budget)
        spec = config.speculative
        drafter = load_drafter(spec.method, path, self.model, self.backend, progress) if spec else None
        self.engine = Engine(self.model, self.backend, self.tokenizer, config, processors, observers, drafter)
        self._chat: ChatRenderer | None = None
        self._next_id = 0

    def _start_ranks(self, arguments: dict) -> None:
        """data_parallel_size > 1: start the engine ranks (each builds its engine from these arguments); this
        process keeps the tokenizer and feeds them."""
        from deepinfer_core.parallel.data_parallel import start_ranks

        self.engine = start_ranks(arguments)
        self.backend = self.model = None
        self.model_name = self.engine.rank_info[0]["model"]
        location = self.engine.rank_info[0]["path"]
        self.model_path = None if location is None else Path(location)
        self.tokenizer_dir = self._tokenizer_dir(
            self.model_path, arguments["tokenizer"], arguments["download_dir"], False
        )
        self.tokenizer = Tokenizer.from_dir(self.tokenizer_dir) if self.tokenizer_dir else None
        self.engine.tokenizer = self.tokenizer
        self._chat, self._next_id = None, 0

    @staticmethod
    def _tokenizer_dir(path: Path | None, tokenizer, download_dir, progress: bool) -> Path | None:
        if tokenizer is None:
            if path is None:
                return demo_tokenizer_dir()
            return path if (path / "tokenizer.json").is_file() else None
        folder, _ = resolve_location(
            tokenizer, what="tokenizer", download_dir=download_dir, files=TOKENIZER_FILES, progress=progress
        )
        if not (folder / "tokenizer.json").is_file():
            raise DeepInferError(
                f"tokenizer {tokenizer} has no tokenizer.json (in {folder}); DeepInfer reads that file"
            )
        return folder

    def _kv_budget(self, num_kv_blocks: int | None, memory_bytes: int | None, utilization: float | None) -> int:
        """The KV-cache byte budget: kv_cache_memory_bytes, else from gpu_memory_utilization, else 1 GiB."""
        if utilization is None or num_kv_blocks is not None or memory_bytes is not None:
            if utilization is not None:
                log.info(
                    "the KV cache is sized by num_kv_blocks / kv_cache_memory_bytes: gpu_memory_utilization is ignored"
                )
            return DEFAULT_KV_CACHE_BYTES if memory_bytes is None else memory_bytes
        weights = model_bytes(self.model, self.backend.torch_device)  # not the tables kept in host memory
        return kv_budget_from_utilization(utilization, self.backend.device, weights)

    # ---- requests -------------------------------------------------------------------------------

    def get_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise DeepInferError(f"{self.model_name} has no tokenizer.json; pass tokenizer=FOLDER_OR_HUB_ID")
        return self.tokenizer

    def _add(self, batch: list[str | list[int]], params: Params) -> list[str]:
        params = SamplingParams() if params is None else params
        per_prompt = [params] * len(batch) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(batch):
            raise DeepInferError(f"{len(batch)} prompts but {len(per_prompt)} sampling parameter sets")
        if not all(isinstance(p, SamplingParams) for p in per_prompt):
            raise DeepInferError("sampling_params must be a SamplingParams or a list of them, one per prompt")
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

    def _run(self, ids: list[str], use_tqdm: bool | Callable[..., tqdm]) -> list[RequestOutput]:
        """Step the engine until every request in `ids` finished; their final outputs, in order."""
        bar = None
        if use_tqdm:
            make = use_tqdm if callable(use_tqdm) else tqdm
            bar = make(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        wanted, finished = set(ids), {}
        prompt_tokens = output_tokens = 0
        try:
            while len(finished) < len(ids) and self.engine.has_unfinished():
                for output in self.engine.step():
                    if not output.finished or output.request_id not in wanted:
                        continue
                    if isinstance(output, FailedRequest):
                        raise output.error
                    finished[output.request_id] = output
                    if bar is not None:
                        prompt_tokens += len(output.prompt_token_ids)
                        output_tokens += sum(len(c.token_ids) for c in output.outputs)
                        elapsed = bar.format_dict["elapsed"] or 1e-9
                        bar.set_postfix_str(
                            f"est. speed input: {prompt_tokens / elapsed:.2f} toks/s, "
                            f"output: {output_tokens / elapsed:.2f} toks/s",
                            refresh=False,
                        )
                        bar.update(1)
        finally:
            for request_id in wanted - finished.keys():  # interrupted: leave nothing running
                self.engine.abort(request_id)
            if bar is not None:
                bar.close()
        return [finished[i] for i in ids]

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: Params = None,
        *,
        use_tqdm: bool | Callable[..., tqdm] = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        prompts: a string, a list of token ids, {"prompt": str}, {"prompt_token_ids": [...]}, or a list of these.
        sampling_params: one SamplingParams for all prompts, or one per prompt (default: SamplingParams()).
        use_tqdm: a progress bar over finished prompts on stderr (or a tqdm-like factory to make it).
        """
        return self._run(self._add(normalize_prompts(prompts), sampling_params), use_tqdm)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: Params = None,
        *,
        use_tqdm: bool | Callable[..., tqdm] = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """Generate a reply to one conversation (a list of OpenAI-style message dicts) or to each of a list
        of them. The prompt is rendered as the server renders it (deepseek-recipe, DeepSeek-V4 encoding);
        each output's `prompt` is the rendered text and its text is the raw generated text.

        chat_template_kwargs: {"thinking": bool} (or "enable_thinking"), {"reasoning_effort": str}.
        tools: OpenAI tool definitions offered to the model.
        """
        conversations = normalize_conversations(messages)
        renderer = self._chat_renderer()
        rendered = [renderer.render(c, chat_template_kwargs, tools) for c in conversations]
        outputs = self._run(self._add([ids for _, ids in rendered], sampling_params), use_tqdm)
        return [dataclasses.replace(o, prompt=text) for o, (text, _) in zip(outputs, rendered)]

    def _chat_renderer(self) -> ChatRenderer:
        if self._chat is None:
            if self.tokenizer_dir is None:
                raise DeepInferError(
                    f"chat needs a tokenizer, and {self.model_name} has no tokenizer.json; "
                    "pass tokenizer=FOLDER_OR_HUB_ID"
                )
            self._chat = ChatRenderer(self.tokenizer_dir / "tokenizer.json", self.model_name)
        return self._chat

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Generate for one prompt, yielding an output (with its text delta) after every token."""
        batch = normalize_prompts(prompt)
        if len(batch) != 1:
            raise DeepInferError(f"stream takes one prompt, got {len(batch)}; use generate for a batch")
        [request_id] = self._add(batch, sampling_params)
        done = False
        try:
            while not done and self.engine.has_unfinished():
                for output in self.engine.step():
                    if output.request_id == request_id:
                        if isinstance(output, FailedRequest):
                            raise output.error
                        done = output.finished
                        yield output
        finally:
            if not done:  # the caller stopped early: free the request
                self.engine.abort(request_id)
