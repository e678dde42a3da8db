"""Prometheus metrics of the serve loop, exposed at `GET /metrics`.

`ServeMetrics` owns a registry of its own (several gateways may live in one process, as in the
tests) and has one method per thing the gateway observes: finished requests, tokens, time to
first token and per output token, the engine's batch and KV cache, the weight version and swaps,
the recorder's counters and the concurrency limiter's. Every metric is named `flywheel_...`.
Values that other parts keep as running totals (the recorder's, the limiter's) are passed in
as such; the counters advance by the difference. Callbacks registered with `on_scrape` run just
before each scrape, so such values can be read when they are wanted rather than polled.

`install_request_metrics` adds a pure ASGI middleware that reports every HTTP request (its route
template, status and duration) through `request_finished`, errors included. It also leaves its
own `send` in the scope (`flywheel.serve.api.sse.BODY_SEND`) for event streams' body chunks, which need not
pass every inner wrapper once the status is known.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from fastapi import FastAPI, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flywheel.serve.api.sse import BODY_SEND

log = logging.getLogger(__name__)

REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
SWAP_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._requests = Counter("flywheel_requests", "HTTP requests answered, by the tenant whose key sent them (`none`: "
                                 "refused before a key was read, or a route that takes none).", ["endpoint", "status", "tenant"],
                                 registry=r)
        self._pii_dropped = Counter("flywheel_pii_dropped_turns", "Turns served but not recorded: personal data found.",
                                    ["tenant"], registry=r)
        self._pii_redacted = Counter("flywheel_pii_redacted_requests", "Requests whose prompt had personal data replaced.",
                                     ["tenant"], registry=r)
        self._request_seconds = Histogram(
            "flywheel_request_duration_seconds", "Time from a request's arrival to its last byte.",
            ["endpoint"], buckets=REQUEST_BUCKETS, registry=r,
        )
        self._prompt_tokens = Counter("flywheel_prompt_tokens", "Prompt tokens of finished generations.", registry=r)
        self._completion_tokens = Counter("flywheel_completion_tokens", "Tokens generated.", registry=r)
        self._ttft = Histogram(
            "flywheel_time_to_first_token_seconds", "From a request's arrival to its first output token.",
            buckets=TTFT_BUCKETS, registry=r,
        )
        self._tpot = Histogram(
            "flywheel_time_per_output_token_seconds", "Mean time per output token after the first.",
            buckets=TPOT_BUCKETS, registry=r,
        )
        self._batch = Gauge("flywheel_engine_batch_size", "Sequences the engine is decoding.", registry=r)
        self._engine_waiting = Gauge("flywheel_engine_waiting_requests", "Requests queued in the engine.", registry=r)
        self._kv_tokens = Gauge("flywheel_engine_kv_cache_tokens", "Tokens held in the KV cache.", registry=r)
        self._kv_capacity = Gauge(
            "flywheel_engine_kv_cache_capacity_tokens", "Tokens the KV cache can hold (0: not reported).", registry=r
        )
        self._kv_usage = Gauge("flywheel_engine_kv_cache_usage_ratio", "KV cache tokens held / capacity.", registry=r)
        self._version = Gauge("flywheel_weight_version", "Weight version every engine serves (the oldest).", registry=r)
        self._engine_version = Gauge(
            "flywheel_engine_weight_version", "Weight version each engine serves.", ["engine"], registry=r
        )
        self._swap_seconds = Histogram(
            "flywheel_weight_swap_duration_seconds", "Duration of hot weight swaps (its count: swaps done).",
            buckets=SWAP_BUCKETS, registry=r,
        )
        self._recorder_published = Counter("flywheel_recorder_published", "Records acked by the bus.", registry=r)
        self._recorder_dropped = Counter("flywheel_recorder_dropped", "Records lost (queue full, no spill).", registry=r)
        self._recorder_spilled = Counter("flywheel_recorder_spilled", "Records written to the spill files.", registry=r)
        self._recorder_pending = Gauge("flywheel_recorder_pending", "Records not yet acked by the bus.", registry=r)
        self._active = Gauge("flywheel_requests_active", "Requests holding a generation slot.", registry=r)
        self._waiting = Gauge("flywheel_requests_waiting", "Requests waiting for a generation slot.", registry=r)
        self._rejected = Counter("flywheel_requests_rejected", "Requests refused with 429 (overloaded).", registry=r)
        self._best_of = Counter("flywheel_best_of_answers", "Answers drawn several times (`memory.best_of`): `chosen` "
                                "by the checks of the person's wish, or served `as_sampled` where they could not rank.",
                                ["outcome"], registry=r)
        self._totals: dict[Counter, float] = {}
        self._scrape_callbacks: list[Callable[[ServeMetrics], None]] = []

    def request_finished(self, endpoint: str, status: int, seconds: float, tenant: str = "none") -> None:
        self._requests.labels(endpoint, str(status), tenant).inc()
        self._request_seconds.labels(endpoint).observe(seconds)

    def best_of(self, chosen: bool) -> None:
        self._best_of.labels("chosen" if chosen else "as_sampled").inc()

    def tokens(self, prompt: int, completion: int) -> None:
        self._prompt_tokens.inc(prompt)
        self._completion_tokens.inc(completion)

    def time_to_first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def time_per_output_token(self, seconds: float) -> None:
        self._tpot.observe(seconds)

    def engine_state(self, batch_size: int, waiting: int, kv_tokens: int, kv_capacity_tokens: int | None) -> None:
        self._batch.set(batch_size)
        self._engine_waiting.set(waiting)
        self._kv_tokens.set(kv_tokens)
        if kv_capacity_tokens:
            self._kv_capacity.set(kv_capacity_tokens)
            self._kv_usage.set(kv_tokens / kv_capacity_tokens)

    def weight_versions(self, by_engine: dict[str, int]) -> None:
        """Each engine's version (they differ during a rolling swap) and the oldest of them."""
        for engine, version in by_engine.items():
            self._engine_version.labels(engine).set(version)
        self._version.set(min(by_engine.values()))

    def swap(self, seconds: float) -> None:
        self._swap_seconds.observe(seconds)

    def recorder(self, published: int, dropped: int, spilled: int, pending: int) -> None:
        """The recorder's running totals (`Recorder.published`, ...) and its backlog."""
        self._advance(self._recorder_published, published)
        self._advance(self._recorder_dropped, dropped)
        self._advance(self._recorder_spilled, spilled)
        self._recorder_pending.set(pending)

    def personal_data(self, dropped: dict[str, int], redacted: dict[str, int]) -> None:
        """The personal-data policy's running totals by tenant (`PersonalData.dropped`, `.redacted`)."""
        for tenant, total in dropped.items():
            self._advance(self._pii_dropped.labels(tenant), total)
        for tenant, total in redacted.items():
            self._advance(self._pii_redacted.labels(tenant), total)

    def admission(self, active: int, waiting: int, rejected: int) -> None:
        """The concurrency limiter's state (`ConcurrencyLimiter.active`, `.waiting`, `.rejected`)."""
        self._active.set(active)
        self._waiting.set(waiting)
        self._advance(self._rejected, rejected)

    def _advance(self, counter: Counter, total: float) -> None:
        """Move a counter up to a running total kept elsewhere."""
        if total > self._totals.get(counter, 0):
            counter.inc(total - self._totals.get(counter, 0))
            self._totals[counter] = total

    def on_scrape(self, callback: Callable[[ServeMetrics], None]) -> None:
        """Run `callback(self)` before each scrape (to report state kept elsewhere)."""
        self._scrape_callbacks.append(callback)

    def exposition(self) -> bytes:
        """The text exposition of every metric, after the scrape callbacks ran."""
        for callback in self._scrape_callbacks:
            try:
                callback(self)
            except Exception:  # a broken reporter must not take the metrics endpoint down
                log.exception("metrics scrape callback failed")
        return generate_latest(self.registry)


def install_metrics_route(app: FastAPI, metrics: ServeMetrics) -> None:
    """`GET /metrics` in Prometheus' text format."""

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


class RequestMetricsMiddleware:
    def __init__(self, app: ASGIApp, metrics: ServeMetrics, routes: Callable[[], list]):
        self.app = app
        self.metrics = metrics
        self.routes = routes

    def endpoint(self, scope: Scope) -> str:
        """The template of the route the path matches (few label values), or `unmatched`. Matched
        here rather than read from routing, which a request refused earlier never reached."""
        for route in self.routes():
            match, _ = route.matches(scope)
            if match is not Match.NONE:
                return getattr(route, "path", "unmatched")
        return "unmatched"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        arrived = time.monotonic()
        status = 500

        async def observing_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        # An event stream may send its body past the wrappers below (it only needs to show us the start).
        scope[BODY_SEND] = send
        try:
            await self.app(scope, receive, observing_send)
        finally:
            tenant = scope.get("state", {}).get("tenant", "none")
            self.metrics.request_finished(self.endpoint(scope), status, time.monotonic() - arrived, tenant)


def install_request_metrics(app: FastAPI, metrics: ServeMetrics) -> None:
    """Report every request through `metrics.request_finished`; install it last (outermost), so
    that refusals by the other middlewares (401, 413) are counted too."""
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics, routes=lambda: app.routes)
