"""Prometheus metrics of the server and the engine (one registry per server)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["ServerMetrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "deepinfer_requests", "Finished requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("deepinfer_prompt_tokens", "Prompt tokens of all requests", registry=r)
        self.generation_tokens = Counter("deepinfer_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram(
            "deepinfer_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.tbt = Histogram(
            "deepinfer_time_between_tokens_seconds", "Time between tokens", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.running = Gauge("deepinfer_requests_running", "Requests running in the engine", registry=r)
        self.waiting = Gauge("deepinfer_requests_waiting", "Requests waiting for the engine", registry=r)
        self.kv_used = Gauge("deepinfer_kv_blocks_used", "KV-cache blocks in use", registry=r)
        self.kv_total = Gauge("deepinfer_kv_blocks_total", "KV-cache blocks in all", registry=r)
        self.prefix_hit_rate = Gauge(
            "deepinfer_prefix_cache_hit_rate", "Fraction of prompt tokens served from the prefix cache", registry=r
        )

    def observe_engine(self, engine) -> None:
        """Refresh the gauges from the engine (called when /metrics is scraped)."""
        self.running.set(len(engine.scheduler.running))
        self.waiting.set(len(engine.scheduler.waiting))
        self.kv_used.set(engine.blocks.num_used_blocks)
        self.kv_total.set(engine.blocks.num_blocks)
        queries = engine.blocks.prefix_queries
        self.prefix_hit_rate.set(engine.blocks.prefix_hits / queries if queries else 0.0)
