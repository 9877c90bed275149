"""GET /metrics: the engine's counters and queue in Prometheus' text format.

Counters and gauges are read from `engine.stats()` at scrape time (the engine is their
one source; nothing is counted twice); latency histograms are observed by the server
when a request ends. Each app has its own registry, so several apps (tests, Ray
replicas) live in one process.

    tercomp_requests_total                 requests accepted by the engine
    tercomp_requests_finished_total        ... that ended with tokens (not cancelled)
    tercomp_requests_rejected_total        refused: queue full (429)
    tercomp_http_errors_total{status}      answered with an error (4xx, 5xx)
    tercomp_prompt_tokens_total, tercomp_generation_tokens_total
    tercomp_prompt_tokens_cached_total     prompt tokens whose KV rows the prefix cache held
                                           (a free slot's, or copied from a running one)
    tercomp_prompt_tokens_copied_total     ... of which copied from a running sequence's slot
    tercomp_prefix_cache_hit_rate          ... over all prompt tokens (0 to 1)
    tercomp_prefix_cache_tokens            tokens the free slots hold for reuse
    tercomp_draft_tokens_total             speculative drafts verified (--speculative)
    tercomp_draft_tokens_accepted_total    ... of which greedy decoding confirmed
    tercomp_requests_waiting, tercomp_requests_running, tercomp_slots, tercomp_slots_free
    tercomp_engine_steps_total, tercomp_engine_step_seconds_total
    tercomp_generation_tokens_per_second   generated tokens / engine busy seconds
    tercomp_time_to_first_token_seconds    histogram
    tercomp_request_seconds                histogram, submit to last token
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_COUNTERS = [
    ("requests", "requests_total", "requests accepted by the engine"),
    ("requests_finished", "requests_finished", "requests that ended with tokens (not cancelled)"),
    ("requests_rejected", "requests_rejected", "requests refused because the queue was full"),
    ("prompt_tokens", "prompt_tokens_total", "prompt tokens (prefilled or reused)"),
    ("prompt_tokens_cached", "prompt_tokens_cached_total",
     "prompt tokens whose KV rows were reused from the prefix cache"),
    ("prompt_tokens_copied", "prompt_tokens_copied_total",
     "prompt tokens of those whose KV rows were copied from a running sequence's slot"),
    ("generation_tokens", "generated_tokens_total", "tokens generated"),
    ("draft_tokens", "draft_tokens_total", "speculative draft tokens verified"),
    ("draft_tokens_accepted", "draft_tokens_accepted_total",
     "speculative draft tokens that greedy decoding confirmed"),
    ("engine_steps", "steps_total", "engine steps (one batched call each)"),
    ("engine_step_seconds", "step_seconds_total", "seconds spent in engine steps"),
]
_GAUGES = [
    ("requests_waiting", "waiting", "requests queued for a slot"),
    ("requests_running", "running", "requests holding a slot"),
    ("slots", "slots", "cache slots (the most concurrent sequences)"),
    ("slots_free", "free_slots", "cache slots free"),
    ("prefix_cache_tokens", "prefix_cache_tokens", "tokens the free slots hold for reuse"),
]
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _EngineCollector:
    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        s = self.engine.stats()
        for name, key, doc in _COUNTERS:
            yield CounterMetricFamily(f"tercomp_{name}", doc, value=s[key])
        for name, key, doc in _GAUGES:
            yield GaugeMetricFamily(f"tercomp_{name}", doc, value=s[key])
        prompt = s["prompt_tokens_total"]
        yield GaugeMetricFamily("tercomp_prefix_cache_hit_rate",
                                "prompt tokens reused from the prefix cache / prompt tokens",
                                value=s["prompt_tokens_cached_total"] / prompt if prompt else 0.0)
        busy = s["step_seconds_total"]
        yield GaugeMetricFamily("tercomp_generation_tokens_per_second",
                                "tokens generated per second of engine time (all streams)",
                                value=s["generated_tokens_total"] / busy if busy > 0 else 0.0)


class Metrics:
    """The registry of one app: the engine's numbers plus what the server observes."""

    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self.errors = Counter("tercomp_http_errors", "requests answered with an error",
                              ["status"], registry=self.registry)
        self.ttft = Histogram("tercomp_time_to_first_token_seconds",
                              "seconds from submit to the first token", registry=self.registry,
                              buckets=_LATENCY_BUCKETS)
        self.latency = Histogram("tercomp_request_seconds", "seconds from submit to the last "
                                 "token", registry=self.registry, buckets=_LATENCY_BUCKETS)

    def observe(self, req) -> None:
        """A request ended: its time to first token and its latency."""
        if req.first_token is not None:
            self.ttft.observe(req.first_token - req.submitted)
        if req.finished is not None:
            self.latency.observe(req.finished - req.submitted)

    def render(self) -> bytes:
        return generate_latest(self.registry)
