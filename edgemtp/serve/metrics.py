"""``GET /metrics``: Prometheus text format, from one registry per server (not the process-wide
default, so two apps in one process, as in tests, count apart)."""

from __future__ import annotations

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,
                               Histogram, generate_latest)

from ..engine import GenerationResult

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
BE_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 6.0)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, scheduler) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("edgemtp_requests", "HTTP requests answered, by endpoint and "
                                "status code", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("edgemtp_prompt_tokens", "prompt tokens of finished "
                                     "generations", registry=r)
        self.completion_tokens = Counter("edgemtp_completion_tokens", "tokens generated",
                                         registry=r)
        self.forward_calls = Counter("edgemtp_forward_calls", "model forward passes (prefill "
                                     "included)", registry=r)
        self.cancelled = Counter("edgemtp_cancelled", "generations stopped before their end "
                                 "because the client went away", registry=r)
        self.block_efficiency = Histogram("edgemtp_block_efficiency", "block efficiency "
                                          "(tokens per forward pass) per generation",
                                          buckets=BE_BUCKETS, registry=r)
        self.latency = Histogram("edgemtp_request_duration_seconds", "time from the request's "
                                 "arrival to its last byte, generations only", ["endpoint"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.first_token = Histogram("edgemtp_time_to_first_token_seconds", "time from "
                                     "arrival to the first text delta, streaming only",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("edgemtp_queue_wait_seconds", "time a request waited for "
                                    "a free slot", buckets=LATENCY_BUCKETS, registry=r)
        Gauge("edgemtp_queue_length", "requests waiting for a slot", registry=r
              ).set_function(lambda: scheduler.waiting)
        Gauge("edgemtp_running", "generations running", registry=r
              ).set_function(lambda: scheduler.running)
        Gauge("edgemtp_parallel", "slots (--parallel)", registry=r
              ).set_function(lambda: scheduler.parallel)

    def finished(self, result: GenerationResult) -> None:
        st = result.stats
        self.prompt_tokens.inc(st.prompt_tokens)
        self.completion_tokens.inc(len(result.token_ids))
        self.forward_calls.inc(st.forward_calls)
        if st.forward_calls:
            self.block_efficiency.observe(st.block_efficiency)

    def text(self) -> bytes:
        return generate_latest(self.registry)
