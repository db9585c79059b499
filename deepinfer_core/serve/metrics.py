"""Prometheus metrics of the server (one registry per server), under vLLM's names, types, labels and
buckets (vllm/v1/metrics/loggers.py) so that dashboards made for vLLM work unchanged.

Every vLLM series carries the labels `model_name` (the served model name) and `engine` ("0": one engine
per server). Request metrics are recorded by the async engine, which sees every request of every route
(`request_output`, `request_finished`); gauges are read from the engine when /metrics is scraped
(`observe_engine`). Families of ours stay where they add something: `deepinfer_requests_total` by endpoint
and HTTP status (refusals included, which never reach the engine), the KV-cache block counts behind
`vllm:kv_cache_usage_perc`, and the window snapshots of DeepSeek-V4/V4.1 (engine/snapshots.py), which vLLM
does not have: prefix hits that restored one, and the snapshots and host bytes held.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["FINISH_REASONS", "ServerMetrics"]

FINISH_REASONS = ("stop", "length", "abort")  # vLLM's FinishReason values, the finished_reason label
_LABELS = ("model_name", "engine")
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
)  # fmt: skip
_TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
)  # fmt: skip

_COMPILE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
_MASK_BUCKETS = (1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's buckets for token counts)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class ServerMetrics:
    """The server's registry. `bind(model_name, max_model_len)` (done by `build_app`) creates the vLLM
    families, whose labels and token-count buckets depend on the served model."""

    def __init__(self, model_name: str | None = None, max_model_len: int | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "deepinfer_requests", "Finished HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.kv_used = Gauge("deepinfer_kv_blocks_used", "KV-cache blocks in use", registry=r)
        self.kv_total = Gauge("deepinfer_kv_blocks_total", "KV-cache blocks in all", registry=r)
        self.snapshot_hits = Counter(
            "deepinfer_window_snapshot_hits", "Prefix-cache hits that restored a window snapshot", registry=r
        )
        self.snapshots = Gauge("deepinfer_window_snapshots", "Window snapshots held in host memory", registry=r)
        self.snapshot_bytes = Gauge(
            "deepinfer_window_snapshot_bytes", "Host memory the window snapshots take, in bytes", registry=r
        )
        self._snapshot_hits_seen = 0
        self.model_name: str | None = None
        self._prefix_seen = (0, 0)  # the engine's cumulative prefix-cache (queries, hits) at the last scrape
        self._spec = None  # vLLM's spec_decode counters, made at the first scrape of a speculating engine
        self._moe_lb = None  # deepinfer:moe_lb_ratio, made at the first scrape of expert-parallel ranks
        self._spec_seen = (0, 0, 0, 0, [])  # the engine's SpeculativeStats at the last scrape
        if model_name is not None and max_model_len is not None:
            self.bind(model_name, max_model_len)

    def bind(self, model_name: str, max_model_len: int) -> None:
        """Create the vLLM families for this model (once; later calls are no-ops)."""
        if self.model_name is not None:
            return
        self.model_name = model_name
        r, labels = self.registry, (model_name, "0")

        def counter(name: str, doc: str):
            return Counter(name, doc, _LABELS, registry=r).labels(*labels)

        def gauge(name: str, doc: str):
            return Gauge(name, doc, _LABELS, registry=r).labels(*labels)

        def histogram(name: str, doc: str, buckets):
            return Histogram(name, doc, _LABELS, buckets=buckets, registry=r).labels(*labels)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.num_prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.num_generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*_LABELS, "finished_reason"],
            registry=r,
        )
        self.success = {reason: success.labels(*labels, reason) for reason in FINISH_REASONS}
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self.request_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", token_buckets
        )
        self.request_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.", (1, 2, 5, 10, 20))
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", _TTFT_BUCKETS
        )
        self.inter_token = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _TOKEN_LATENCY_BUCKETS
        )
        self.time_per_output_token = histogram(  # vLLM's older name of the same measure, still on many dashboards
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds (the same as vllm:inter_token_latency_seconds).",
            _TOKEN_LATENCY_BUCKETS,
        )
        self.request_time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            _TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", _REQUEST_LATENCY_BUCKETS
        )

        self.grammar_compile = histogram(
            "deepinfer:structured_output_compile_seconds",
            "Time to compile a structured-output constraint into a grammar (cache misses only).",
            _COMPILE_BUCKETS,
        )
        self.grammar_mask = histogram(
            "deepinfer:structured_output_mask_seconds",
            "Host time to fill one constrained request's token mask for one step.",
            _MASK_BUCKETS,
        )

    # ---- recorded by the async engine ------------------------------------------------------------

    def request_output(self, interval: float, num_new_tokens: int, num_prompt_tokens: int | None = None) -> None:
        """One report of a request, `interval` seconds after the previous one, carrying `num_new_tokens`
        tokens (all samples). The first report gives `num_prompt_tokens`, and its interval (since arrival)
        is the time to first token; prompt tokens are counted then, as vLLM does."""
        if self.model_name is None:
            return
        if num_prompt_tokens is not None:
            self.time_to_first_token.observe(interval)
            self.num_prompt_tokens.inc(num_prompt_tokens)
        else:
            self.inter_token.observe(interval)
            self.time_per_output_token.observe(interval)
        self.num_generation_tokens.inc(num_new_tokens)

    def request_finished(
        self,
        finished_reason: str,
        num_prompt_tokens: int,
        num_generation_tokens: int,
        e2e: float,
        ttft: float | None,
        max_tokens: int,
        n: int,
    ) -> None:
        """A request left the engine: finished ("stop", "length") or aborted ("abort")."""
        if self.model_name is None:
            return
        self.success[finished_reason if finished_reason in self.success else "abort"].inc()
        self.e2e.observe(e2e)
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_generation_tokens)
        self.request_max_tokens.observe(max_tokens)
        self.request_n.observe(n)
        if ttft is not None and num_generation_tokens > 1:
            self.request_time_per_output_token.observe((e2e - ttft) / (num_generation_tokens - 1))

    # ---- read at scrape time ---------------------------------------------------------------------

    def observe_engine(self, engine) -> None:
        """Refresh the gauges and the prefix-cache counters from the engine (called when /metrics is scraped)."""
        blocks = engine.blocks
        self.kv_used.set(blocks.num_used_blocks)
        self.kv_total.set(blocks.num_blocks)
        if (snapshots := blocks.snapshots) is not None:
            self.snapshot_hits.inc(max(0, snapshots.hits - self._snapshot_hits_seen))
            self._snapshot_hits_seen = snapshots.hits
            self.snapshots.set(snapshots.num_snapshots)
            self.snapshot_bytes.set(snapshots.nbytes)
        if self.model_name is None:
            return
        self.running.set(len(engine.scheduler.running))
        self.waiting.set(len(engine.scheduler.waiting))
        self.kv_usage.set(blocks.num_used_blocks / blocks.num_blocks if blocks.num_blocks else 0.0)
        seen_queries, seen_hits = self._prefix_seen
        self.prefix_queries.inc(max(0, blocks.prefix_queries - seen_queries))
        self.prefix_hits.inc(max(0, blocks.prefix_hits - seen_hits))
        self._prefix_seen = (blocks.prefix_queries, blocks.prefix_hits)
        if (stats := getattr(engine, "spec_stats", None)) is not None:
            self._observe_speculation(stats)
        if (moe_lb := getattr(engine, "moe_lb_ratios", None)) is not None and (ratios := moe_lb()) is not None:
            self._observe_moe_lb(ratios)
        if (structured := getattr(engine, "structured_stats", None)) is not None:
            compiled, masks = structured.drain()
            for seconds in compiled:
                self.grammar_compile.observe(seconds)
            for seconds in masks:
                self.grammar_mask.observe(seconds)

    def _observe_moe_lb(self, ratios: list[float]) -> None:
        """deepinfer:moe_lb_ratio per MoE layer (its index among them) and over all ("all": their mean)."""
        if self._moe_lb is None:
            self._moe_lb = Gauge(
                "deepinfer:moe_lb_ratio",
                "Expert-parallel load balance since the last scrape: the busiest rank's expert rows over the mean "
                "(1.0 is perfect balance), per MoE layer and over all (their mean).",
                [*_LABELS, "layer"],
                registry=self.registry,
            )
        for layer, ratio in enumerate(ratios):
            self._moe_lb.labels(self.model_name, "0", str(layer)).set(ratio)
        self._moe_lb.labels(self.model_name, "0", "all").set(sum(ratios) / len(ratios))

    def _observe_speculation(self, stats) -> None:
        """vLLM's spec_decode counters from the engine's SpeculativeStats (engine/speculative.py)."""
        labels = (self.model_name, "0")
        if self._spec is None:

            def counter(name: str, doc: str):
                return Counter(name, doc, _LABELS, registry=self.registry).labels(*labels)

            self._spec = (
                counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
                counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
                counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."),
                counter(
                    "deepinfer:spec_decode_num_proposed_tokens",
                    "Draft tokens proposed, before adaptive verification chose those to verify (num_draft_tokens).",
                ),
                Gauge(
                    "deepinfer:spec_decode_mean_accepted_length",
                    "Tokens a verify step yields on average: its accepted drafts plus its own.",
                    _LABELS,
                    registry=self.registry,
                ).labels(*labels),
                Counter(
                    "vllm:spec_decode_num_accepted_tokens_per_pos",
                    "Accepted draft tokens per draft position.",
                    [*_LABELS, "position"],
                    registry=self.registry,
                ),
            )
        *totals, mean_length, per_position = self._spec
        now = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_proposed_tokens)
        for counter_, value, before in zip(totals, now, self._spec_seen[:4]):
            counter_.inc(max(0, value - before))
        mean_length.set(stats.mean_accepted_length)
        seen_positions, positions = self._spec_seen[4], list(stats.accepted_per_position or [])
        for position, value in enumerate(positions):
            before = seen_positions[position] if position < len(seen_positions) else 0
            per_position.labels(*labels, str(position)).inc(max(0, value - before))
        self._spec_seen = (*now, positions)
