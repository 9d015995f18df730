"""Prometheus metrics under vLLM's names (`vllm:` prefix), so existing dashboards work.

| metric | kind |
| --- | --- |
| vllm:num_requests_running, vllm:num_requests_waiting | gauge |
| vllm:kv_cache_usage_perc (also vllm:gpu_cache_usage_perc) | gauge, 0..1 |
| vllm:num_preemptions_total | counter |
| vllm:prompt_tokens_total, vllm:generation_tokens_total | counter |
| vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total (tokens) | counter |
| vllm:request_success_total{finished_reason} | counter |
| vllm:time_to_first_token_seconds | histogram |
| vllm:inter_token_latency_seconds (also vllm:time_per_output_token_seconds) | histogram |
| vllm:e2e_request_latency_seconds, vllm:request_queue_time_seconds | histogram |
| jaxserve:compile_seconds{kind=step|score} (trace, lower and compile of one bucket) | histogram |
| jaxserve:xla_compilations_total (every XLA compile in the process) | counter |
| jaxserve:executable_cache_loads_total (buckets loaded from disk, not compiled) | counter |
| jaxserve:warm_up_done (1 once every bucket is compiled) | gauge |

Every series carries the label model_name; the jaxserve: series describe the process. Gauges are set from the engine loop after every
step, and return to 0 when the engine is idle.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from jaxserve.compilation import (
    COMPILE_BUCKETS,
    compilation_count,
    compile_times,
    executable_loads,
)

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                  0.75, 1.0, 2.5, 5.0)


class CompileCollector:
    """The jaxserve: series, read at each scrape from the process-wide compile records."""

    def __init__(self, model_name: str, warm_up_done: Callable[[], bool]) -> None:
        self.model_name = model_name
        self.warm_up_done = warm_up_done

    def collect(self):
        seconds = HistogramMetricFamily(
            "jaxserve:compile_seconds", "Seconds to trace, lower and compile one function.",
            labels=["model_name", "kind"])
        for kind, times in sorted(compile_times().items()):
            buckets = [(str(b), n) for b, n in zip(COMPILE_BUCKETS, times.buckets)]
            seconds.add_metric([self.model_name, kind], buckets + [("+Inf", times.count)],
                               times.total)
        yield seconds
        yield CounterMetricFamily("jaxserve:xla_compilations",
                                  "XLA compilations in this process.",
                                  value=compilation_count(), labels=None)
        yield CounterMetricFamily("jaxserve:executable_cache_loads",
                                  "Functions loaded from the executable cache.",
                                  value=executable_loads(), labels=None)
        yield GaugeMetricFamily("jaxserve:warm_up_done", "1 once every bucket is compiled.",
                                value=float(self.warm_up_done()))


class EngineMetrics:
    def __init__(self, model_name: str, *,
                 warm_up_done: Callable[[], bool] = lambda: True) -> None:
        """warm_up_done: whether the engine has compiled every bucket (for the gauge)."""
        self.registry = CollectorRegistry()
        self.registry.register(CompileCollector(model_name, warm_up_done))
        labels = {"model_name": model_name}
        r = self.registry

        def gauge(name, doc):
            return Gauge(name, doc, list(labels), registry=r).labels(**labels)

        def counter(name, doc):
            return Counter(name, doc, list(labels), registry=r).labels(**labels)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, list(labels), buckets=buckets,
                             registry=r).labels(**labels)

        self.running = gauge("vllm:num_requests_running", "Requests being computed.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to run.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).")
        self.gpu_cache_usage = gauge("vllm:gpu_cache_usage_perc",
                                     "Same as vllm:kv_cache_usage_perc (older name).")
        self.preemptions = counter("vllm:num_preemptions", "Preemptions (recompute).")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens admitted.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in tokens looked up.")
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in tokens served from the cache.")
        self.request_success = Counter("vllm:request_success", "Finished requests.",
                                       ["model_name", "finished_reason"], registry=r)
        self._request_success_labels = labels
        self.time_to_first_token = histogram("vllm:time_to_first_token_seconds",
                                             "Time to first token.", _LATENCY_BUCKETS)
        self.inter_token_latency = histogram("vllm:inter_token_latency_seconds",
                                             "Time between output tokens.", _TOKEN_BUCKETS)
        self.time_per_output_token = histogram(
            "vllm:time_per_output_token_seconds",
            "Same as vllm:inter_token_latency_seconds (older name).", _TOKEN_BUCKETS)
        self.e2e_latency = histogram("vllm:e2e_request_latency_seconds",
                                     "End-to-end request latency.", _LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Time from arrival to first scheduling.", _LATENCY_BUCKETS)
        self._preemptions_seen = 0
        self._prefix_cache_seen = (0, 0)  # (queries, hits) already counted
        self._tokens = [0, 0]

    def update_gauges(self, *, running: int, waiting: int, kv_usage: float,
                      preemptions: int, prefix_cache: tuple[int, int] = (0, 0)) -> None:
        """prefix_cache: the engine's running totals (queries, hits), in tokens."""
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)
        self.gpu_cache_usage.set(kv_usage)
        if preemptions > self._preemptions_seen:
            self.preemptions.inc(preemptions - self._preemptions_seen)
            self._preemptions_seen = preemptions
        # The engine keeps running totals; counters take the increase since the last call.
        new_queries = prefix_cache[0] - self._prefix_cache_seen[0]
        new_hits = prefix_cache[1] - self._prefix_cache_seen[1]
        if new_queries > 0:
            self.prefix_cache_queries.inc(new_queries)
        if new_hits > 0:
            self.prefix_cache_hits.inc(new_hits)
        self._prefix_cache_seen = prefix_cache

    def finished(self, reason: str) -> None:
        self.request_success.labels(finished_reason=reason, **self._request_success_labels).inc()

    def token_gap(self, seconds: float) -> None:
        self.inter_token_latency.observe(seconds)
        self.time_per_output_token.observe(seconds)

    def token_totals(self) -> tuple[float, float]:
        return (self.prompt_tokens._value.get(), self.generation_tokens._value.get())

    def render(self) -> bytes:
        return generate_latest(self.registry)
