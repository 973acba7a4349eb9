"""Prometheus metrics under vLLM's names, with the `inherent:` prefix.

Every metric lives in the registry passed in, so tests and several engines in one process do
not clash; pass `prometheus_client.REGISTRY` to expose them on the default /metrics. Gauges
and counters are updated once per step; per-request histograms when a request finishes, from
its timeline summary.
"""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine.timeline import TimelineSummary

PREFIX = "inherent:"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                   30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str = "inherent"):
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]):
            return Histogram(PREFIX + name, doc, labels, buckets=buckets,
                             registry=registry).labels(model_name)

        def gauge(name: str, doc: str):
            return Gauge(PREFIX + name, doc, labels, registry=registry).labels(model_name)

        def counter(name: str, doc: str):
            return Counter(PREFIX + name, doc, labels, registry=registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between two output tokens.",
                             TOKEN_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "Decode time of a request per output token after the first.",
                              TOKEN_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.",
                             REQUEST_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.",
                               REQUEST_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds",
                                 "First scheduled to first token.", REQUEST_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "First token to last token.",
                                REQUEST_BUCKETS)
        # What `inherent diagnose` reads from /metrics as the interference phase.
        self.interference = histogram(
            "request_interference_time_seconds",
            "Decode time a request lost to other requests' prefill in its steps.",
            REQUEST_BUCKETS)
        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).")
        self.preemptions = counter("num_preemptions", "Requests preempted (by recompute).")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self._success = Counter(PREFIX + "request_success", "Finished requests.",
                                ["model_name", "finished_reason"], registry=registry)
        self._model_name = model_name
        self._last = (0, 0, 0)  # preemptions, prefix queries, prefix hits seen so far

    def observe_step(self, num_running: int, num_waiting: int, kv_usage: float,
                     num_generated: int, num_preemptions: int, prefix_queries: int,
                     prefix_hits: int) -> None:
        """Per-step update; the last three are the engine's running totals."""
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.kv_usage.set(kv_usage)
        self.generation_tokens.inc(num_generated)
        last_preemptions, last_queries, last_hits = self._last
        self.preemptions.inc(num_preemptions - last_preemptions)
        self.prefix_queries.inc(prefix_queries - last_queries)
        self.prefix_hits.inc(prefix_hits - last_hits)
        self._last = (num_preemptions, prefix_queries, prefix_hits)

    def observe_finished(self, summary: TimelineSummary) -> None:
        """A finished request's summary (the engine's: it names the reason and prompt)."""
        self._success.labels(self._model_name, summary.finish_reason.value).inc()
        self.prompt_tokens.inc(summary.num_prompt_tokens)
        for histogram, value in ((self.ttft, summary.ttft), (self.tpot, summary.tpot),
                                 (self.e2e, summary.e2e), (self.queue, summary.queue_time),
                                 (self.prefill, summary.prefill_time),
                                 (self.decode, summary.decode_time),
                                 (self.interference, summary.interference_time)):
            if value is not None:
                histogram.observe(value)
        for gap in summary.itl:
            self.itl.observe(gap)
