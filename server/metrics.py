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
| vllm:request_prefill_time_seconds, vllm:request_decode_time_seconds | histogram |
| vllm:request_inference_time_seconds, vllm:request_time_per_output_token_seconds | histogram |
| vllm:request_prompt_tokens, vllm:request_generation_tokens | histogram (tokens) |
| vllm:request_max_num_generation_tokens, vllm:request_params_max_tokens | histogram (tokens) |
| vllm:request_params_n | histogram |
| vllm:spec_decode_num_drafts_total, vllm:spec_decode_num_draft_tokens_total | counter |
| vllm:spec_decode_num_accepted_tokens_total | counter |
| vllm:spec_decode_num_accepted_tokens_per_pos_total{position} | counter |
| jaxserve:compile_seconds{kind=step|score} (trace, lower and compile of one bucket) | histogram |
| jaxserve:xla_compilations_total (every XLA compile in the engine's process) | counter |
| jaxserve:executable_cache_loads_total (buckets loaded from disk, not compiled) | counter |
| jaxserve:warm_up_done (1 once every bucket is compiled) | gauge |
| jaxserve:data_parallel_replicas{state=serving|lost} (lost: its host died) | gauge |

Every series carries the label model_name; the jaxserve: series describe the process. Gauges are set from the engine loop after every
step, and return to 0 when the engine is idle. Histogram buckets are vLLM's (v1 metrics), so
its dashboards' quantiles read the same: latencies up to 7680 s, token counts on a 1-2-5
series up to max_model_len.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from jaxserve.backends.compile_stats import (
    COMPILE_BUCKETS,
    CompileRecords,
    compile_records,
)

# vLLM's buckets (vllm/v1/metrics): whole requests, time to first token, between tokens.
_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                            40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                          2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_N_BUCKETS = (1, 2, 5, 10, 20)


def one_two_five_buckets(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to limit (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > limit:
                return tuple(out)
            out.append(step * scale)
        scale *= 10


class CompileCollector:
    """The jaxserve: series, read at each scrape from the compile records of the process
    where the engine compiles (records: a callable returning compile_stats.CompileRecords)."""

    def __init__(self, model_name: str, warm_up_done: Callable[[], bool],
                 records: Callable[[], CompileRecords]) -> None:
        self.model_name = model_name
        self.warm_up_done = warm_up_done
        self.records = records

    def collect(self):
        records = self.records()
        seconds = HistogramMetricFamily(
            "jaxserve:compile_seconds", "Seconds to trace, lower and compile one function.",
            labels=["model_name", "kind"])
        for kind, times in sorted(records.times.items()):
            buckets = [(str(b), n) for b, n in zip(COMPILE_BUCKETS, times.buckets)]
            seconds.add_metric([self.model_name, kind], buckets + [("+Inf", times.count)],
                               times.total)
        yield seconds
        yield CounterMetricFamily("jaxserve:xla_compilations",
                                  "XLA compilations in the engine's process.",
                                  value=records.compilations, labels=None)
        yield CounterMetricFamily("jaxserve:executable_cache_loads",
                                  "Functions loaded from the executable cache.",
                                  value=records.executable_loads, labels=None)
        yield GaugeMetricFamily("jaxserve:warm_up_done", "1 once every bucket is compiled.",
                                value=float(self.warm_up_done()))


class LoraCollector:
    """vllm:lora_requests_info, read at each scrape from the engine's latest stats: its
    labels name the adapters of the running and of the waiting requests (comma-separated)
    and max_lora; its value is the time of the reading (vLLM's)."""

    def __init__(self, model_name: str, stats: Callable) -> None:
        self.model_name, self.stats = model_name, stats

    def collect(self):
        stats = self.stats()
        info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests.",
                                 labels=["model_name", "max_lora", "waiting_lora_adapters",
                                         "running_lora_adapters"])
        info.add_metric([self.model_name, str(stats.max_loras), ",".join(stats.lora_waiting),
                         ",".join(stats.lora_running)], time.time())
        yield info


class _Series:
    """Makes series in one registry, each labelled with the model's name."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.registry, self.model_name = registry, model_name

    def gauge(self, name: str, doc: str):
        return Gauge(name, doc, ["model_name"], registry=self.registry).labels(
            model_name=self.model_name)

    def counter(self, name: str, doc: str):
        return Counter(name, doc, ["model_name"], registry=self.registry).labels(
            model_name=self.model_name)

    def histogram(self, name: str, doc: str, buckets):
        return Histogram(name, doc, ["model_name"], buckets=buckets,
                         registry=self.registry).labels(model_name=self.model_name)

    def by(self, kind, name: str, doc: str, label: str, values) -> dict:
        """One series of kind (Gauge, Counter) per value of a second label."""
        family = kind(name, doc, ["model_name", label], registry=self.registry)
        return {value: family.labels(model_name=self.model_name, **{label: value})
                for value in values}


class EngineMetrics:
    def __init__(self, model_name: str, *,
                 warm_up_done: Callable[[], bool] = lambda: True,
                 max_model_len: int = 8192, num_speculative_tokens: int = 0,
                 compile_records: Callable[[], CompileRecords] = compile_records,
                 lora_stats: Callable | None = None) -> None:
        """warm_up_done: whether the engine has compiled every bucket (for the gauge);
        max_model_len: the top of the token-count buckets; num_speculative_tokens: K of
        speculative decoding (0: off, and no vllm:spec_decode_* series); compile_records:
        the compile records of the engine's process (default: this one's); lora_stats: the
        engine's latest EngineStats, with LoRA on (vllm:lora_requests_info)."""
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(CompileCollector(model_name, warm_up_done, compile_records))
        if lora_stats is not None:
            self.registry.register(LoraCollector(model_name, lora_stats))
        series = _Series(self.registry, model_name)
        self._init_engine_series(series)
        self._init_latency_series(series)
        self._init_token_series(series, max_model_len)
        self._init_spec_decode_series(series, num_speculative_tokens)
        self._preemptions_seen = 0
        self._prefix_cache_seen = (0, 0)  # (queries, hits) already counted
        self._tokens = [0, 0]

    def _init_engine_series(self, series: _Series) -> None:
        """The engine's load (gauges set after every step) and its running counters."""
        self.running = series.gauge("vllm:num_requests_running", "Requests being computed.")
        self.waiting = series.gauge("vllm:num_requests_waiting", "Requests waiting to run.")
        self.kv_usage = series.gauge("vllm:kv_cache_usage_perc",
                                     "Fraction of KV blocks in use (0-1).")
        self.gpu_cache_usage = series.gauge("vllm:gpu_cache_usage_perc",
                                            "Same as vllm:kv_cache_usage_perc (older name).")
        self.replicas = series.by(
            Gauge, "jaxserve:data_parallel_replicas",
            "Data-parallel replicas serving, and lost (their host died).",
            "state", ("serving", "lost"))
        self.replicas["serving"].set(1)
        self.preemptions = series.counter("vllm:num_preemptions", "Preemptions (recompute).")
        self.prompt_tokens = series.counter("vllm:prompt_tokens", "Prompt tokens admitted.")
        self.generation_tokens = series.counter("vllm:generation_tokens", "Tokens generated.")
        self.prefix_cache_queries = series.counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in tokens looked up.")
        self.prefix_cache_hits = series.counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in tokens served from the cache.")
        self.request_success = Counter("vllm:request_success", "Finished requests.",
                                       ["model_name", "finished_reason"],
                                       registry=self.registry)

    def _init_latency_series(self, series: _Series) -> None:
        """Each finished request's times, on vLLM's buckets."""
        self.time_to_first_token = series.histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.inter_token_latency = series.histogram(
            "vllm:inter_token_latency_seconds", "Time between output tokens.",
            _TOKEN_LATENCY_BUCKETS)
        self.time_per_output_token = series.histogram(
            "vllm:time_per_output_token_seconds",
            "Same as vllm:inter_token_latency_seconds (older name).", _TOKEN_LATENCY_BUCKETS)
        self.request_time_per_output_token = series.histogram(
            "vllm:request_time_per_output_token_seconds",
            "Mean time per output token of each request (its decode time / (tokens - 1)).",
            _TOKEN_LATENCY_BUCKETS)
        for attribute, name, doc in (
                ("e2e_latency", "vllm:e2e_request_latency_seconds",
                 "End-to-end request latency."),
                ("queue_time", "vllm:request_queue_time_seconds",
                 "Time from arrival to first scheduling."),
                ("prefill_time", "vllm:request_prefill_time_seconds",
                 "Time from first scheduling to the first token."),
                ("decode_time", "vllm:request_decode_time_seconds",
                 "Time from the first token to the last."),
                ("inference_time", "vllm:request_inference_time_seconds",
                 "Time from first scheduling to the last token.")):
            setattr(self, attribute, series.histogram(name, doc, _REQUEST_LATENCY_BUCKETS))

    def _init_token_series(self, series: _Series, max_model_len: int) -> None:
        """Each finished request's token counts (1-2-5 buckets up to max_model_len) and n."""
        tokens = one_two_five_buckets(max_model_len)
        self.request_prompt_tokens = series.histogram(
            "vllm:request_prompt_tokens", "Prompt tokens of each request.", tokens)
        self.request_generation_tokens = series.histogram(
            "vllm:request_generation_tokens", "Generated tokens of each request (all its "
            "sequences).", tokens)
        self.request_max_generation_tokens = series.histogram(
            "vllm:request_max_num_generation_tokens", "Most tokens generated by one sequence "
            "of each request.", tokens)
        self.request_params_max_tokens = series.histogram(
            "vllm:request_params_max_tokens", "max_tokens of each request.", tokens)
        self.request_params_n = series.histogram("vllm:request_params_n",
                                                 "n of each request.", _N_BUCKETS)

    def _init_spec_decode_series(self, series: _Series, num_speculative_tokens: int) -> None:
        """The vllm:spec_decode_* counters, with speculative decoding on (K > 0) only."""
        self.spec_decode = None
        self._spec_seen = (0, 0, 0, (0,) * num_speculative_tokens)
        if not num_speculative_tokens:
            return
        self.spec_decode = [
            series.counter("vllm:spec_decode_num_drafts",
                           "Steps of a sequence that verified speculative proposals."),
            series.counter("vllm:spec_decode_num_draft_tokens", "Proposals verified."),
            series.counter("vllm:spec_decode_num_accepted_tokens", "Proposals accepted.")]
        per_pos = series.by(Counter, "vllm:spec_decode_num_accepted_tokens_per_pos",
                            "Proposals accepted, by their position among a step's "
                            "proposals.", "position",
                            [str(i) for i in range(num_speculative_tokens)])
        self.spec_decode_per_pos = list(per_pos.values())

    def update_gauges(self, *, running: int, waiting: int, kv_usage: float,
                      preemptions: int, prefix_cache: tuple[int, int] = (0, 0),
                      replicas: tuple[int, int] = (1, 0)) -> None:
        """prefix_cache: the engine's running totals (queries, hits), in tokens; replicas:
        data-parallel replicas (serving, lost)."""
        self.replicas["serving"].set(replicas[0])
        self.replicas["lost"].set(replicas[1])
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

    def update_spec_decode(self, drafts: int, draft_tokens: int, accepted: int,
                           accepted_per_pos: tuple[int, ...]) -> None:
        """The engine's running totals of speculative decoding (EngineStats.spec_*)."""
        if self.spec_decode is None:
            return
        seen = self._spec_seen
        for series, total, before in zip(self.spec_decode, (drafts, draft_tokens, accepted),
                                         seen):
            if total > before:
                series.inc(total - before)
        for series, total, before in zip(self.spec_decode_per_pos, accepted_per_pos, seen[3]):
            if total > before:
                series.inc(total - before)
        self._spec_seen = (drafts, draft_tokens, accepted, tuple(accepted_per_pos))

    def finished(self, reason: str) -> None:
        self.request_success.labels(model_name=self.model_name, finished_reason=reason).inc()

    def request_finished(self, output, arrival: float, first_token: float | None, now: float,
                         n: int, max_tokens: int) -> None:
        """The per-request series of a finished request (times on time.monotonic())."""
        self.e2e_latency.observe(now - arrival)
        # (a pooling request's output is one vector, no choices: it ended as a whole)
        choices = output.outputs if isinstance(output.outputs, list) else []
        reasons = sorted({c.finish_reason or "abort" for c in choices}
                         or {output.finish_reason or "abort"})
        for reason in reasons:
            self.finished(reason)
        lengths = [len(c.token_ids) for c in choices]
        self.request_prompt_tokens.observe(len(output.prompt_token_ids))
        self.request_generation_tokens.observe(sum(lengths))
        self.request_max_generation_tokens.observe(max(lengths, default=0))
        self.request_params_n.observe(n)
        self.request_params_max_tokens.observe(max_tokens)
        scheduled = output.metrics.first_scheduled_time if output.metrics else None
        if scheduled is None:
            return  # never ran (aborted while waiting)
        self.queue_time.observe(output.metrics.time_in_queue)
        self.inference_time.observe(max(0.0, now - scheduled))
        if first_token is not None:
            self.prefill_time.observe(max(0.0, first_token - scheduled))
            self.decode_time.observe(max(0.0, now - first_token))
            longest = max(lengths, default=0)
            if longest > 1:
                self.request_time_per_output_token.observe((now - first_token) / (longest - 1))

    def token_gap(self, seconds: float) -> None:
        self.inter_token_latency.observe(seconds)
        self.time_per_output_token.observe(seconds)

    def token_totals(self) -> tuple[float, float]:
        return (self.prompt_tokens._value.get(), self.generation_tokens._value.get())

    def render(self) -> bytes:
        return generate_latest(self.registry)
