"""`kiln serve-model`'s Prometheus metrics (GET /metrics): what a team's dashboard scrapes to see
a served model's load and latency. Names follow vLLM's where vLLM has one (`kiln_` for `vllm:`),
so a dashboard built for vLLM needs its prefix changed only:

    kiln_requests_total{endpoint, status}            HTTP requests answered (status as sent)
    kiln_prompt_tokens_total, kiln_generation_tokens_total   tokens of the answered requests
    kiln_e2e_request_latency_seconds{endpoint}       arrival to the whole answer (a stream's [DONE])
    kiln_time_to_first_token_seconds                 streamed requests: arrival to the first text
    kiln_batch_jobs, kiln_batch_seconds              rows decoding in each chunk of steps the engine ran,
                                                     and what the chunk took
    kiln_num_requests_waiting, kiln_num_requests_running   jobs queued for a slot, and decoding, now
    kiln_prefix_cache_queries_total, kiln_prefix_cache_hits_total   prompt tokens admitted, and those
                                                     whose keys and values the prefix cache held

Each server has a registry of its own (two in one process do not mix). No Prefect here.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
JOBS = (1, 2, 4, 8, 16, 32, 64, 128)
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/tokenize",
             "/detokenize", "/tokenizer_info")


class ServingMetrics:
    def __init__(self, model_name: str, waiting: Callable[[], int], running: Callable[[], int]):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("kiln_requests", "HTTP requests answered, by endpoint and status",
                                ["model_name", "endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("kiln_prompt_tokens", "prompt tokens of the answered requests",
                                     ["model_name"], registry=r).labels(model_name)
        self.generation_tokens = Counter("kiln_generation_tokens", "completion tokens of the answered requests",
                                         ["model_name"], registry=r).labels(model_name)
        self.latency = Histogram("kiln_e2e_request_latency_seconds", "arrival to the whole answer",
                                 ["model_name", "endpoint"], buckets=SECONDS, registry=r)
        self.first_token = Histogram("kiln_time_to_first_token_seconds", "streamed requests: arrival to the "
                                     "first text sent", ["model_name"], buckets=SECONDS, registry=r).labels(model_name)
        self.batch_jobs = Histogram("kiln_batch_jobs", "rows decoding in each chunk the engine ran", ["model_name"],
                                    buckets=JOBS, registry=r).labels(model_name)
        self.batch_seconds = Histogram("kiln_batch_seconds", "what each chunk took the engine", ["model_name"],
                                       buckets=SECONDS, registry=r).labels(model_name)
        Gauge("kiln_num_requests_waiting", "jobs queued for a slot", ["model_name"],
              registry=r).labels(model_name).set_function(waiting)
        Gauge("kiln_num_requests_running", "jobs decoding in a slot", ["model_name"],
              registry=r).labels(model_name).set_function(running)
        self.prefix_queries = Counter("kiln_prefix_cache_queries", "prompt tokens admitted to a slot",
                                      ["model_name"], registry=r).labels(model_name)
        self.prefix_hits = Counter("kiln_prefix_cache_hits", "admitted prompt tokens whose keys and values the "
                                   "prefix cache held", ["model_name"], registry=r).labels(model_name)
        self.model_name = model_name

    def answered(self, endpoint: str, prompt_tokens: int, generation_tokens: int, seconds: float) -> None:
        """A whole answer went out: its tokens and how long it took from arrival."""
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        self.latency.labels(self.model_name, endpoint).observe(seconds)

    def ran_chunk(self, rows: int, seconds: float) -> None:
        self.batch_jobs.observe(rows)
        self.batch_seconds.observe(seconds)

    def looked_up(self, tokens: int, cached: int) -> None:
        """Prompts of `tokens` tokens were admitted, `cached` of them from the prefix cache."""
        self.prefix_queries.inc(tokens)
        self.prefix_hits.inc(cached)

    def exposition(self) -> tuple[bytes, str]:
        """The text a scrape gets, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class CountRequests:
    """ASGI middleware: counts every HTTP answer by endpoint (paths kiln does not serve: `other`,
    so a scanner cannot grow the label set) and status, as the status line goes out (a stream's
    too, before its body)."""

    def __init__(self, app, metrics: ServingMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = "/v1/models/{name}" if path.startswith("/v1/models/") else path if path in ENDPOINTS else "other"

        async def sending(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(self.metrics.model_name, endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, sending)
