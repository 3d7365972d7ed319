"""OpenTelemetry tracing and metrics through the global providers: nothing is recorded or exported
unless the application installs SDK providers (opentelemetry-sdk) with an exporter or reader (the
`prometheus` extra and `tieredkv.serve.install_prometheus` give a scrapeable /metrics).

Names follow OpenTelemetry's semantic conventions for generative AI servers where one exists
(`gen_ai.server.*`); the rest are `tieredkv.*`. The "Metrics" table in docs/guide/observability.md lists them
all with the vLLM metric each corresponds to. Histogram buckets fit what they measure (seconds from milliseconds up,
tokens from 1 to 8192), not the SDK's defaults.
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from typing import Any, Callable, Sequence

from opentelemetry import metrics, trace
from opentelemetry.metrics import Observation

_SCOPE = "tieredkv"
LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 30.0, 60.0]
TOKEN_LATENCY_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5]
TOKEN_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
TIER_COUNTERS = {"promotions": "{block}", "demotions": "{block}", "evictions": "{block}", "failures": "{failure}",
                 "bytes_read": "By", "bytes_written": "By", "round_trips": "{round_trip}"}

# Observable instruments exist once per process (creating one again returns the first, with its
# callbacks), so their callbacks report every live engine, each under its own `engine` attribute.
_LIVE: "weakref.WeakSet[Telemetry]" = weakref.WeakSet()
_REGISTERED = threading.Lock()
_registered: list[bool] = []
_ids = itertools.count()


class Telemetry:
    """Per-engine instruments. The worker thread records events as they happen (`on_*`); gauges and
    per-tier counters are read from `snapshot`, the stats the worker publishes after every step."""

    def __init__(self, silent: bool = False) -> None:
        """`silent`: instruments that record nothing (an engine serving another's drafts, not requests)."""
        self.snapshot = None  # EngineStats, set by the worker
        self.tracer = trace.NoOpTracer() if silent else trace.get_tracer(_SCOPE)
        m = metrics.NoOpMeter(_SCOPE) if silent else metrics.get_meter(_SCOPE)
        self.requests = m.create_counter("tieredkv.requests", unit="{request}",
                                         description="requests ended, by finish_reason (stop, length, abort, "
                                                     "error, rejected)")
        self.prompt_tokens = m.create_counter("tieredkv.prompt_tokens", unit="{token}",
                                              description="prompt tokens of finished requests, by source "
                                                          "(computed, hot, warm, remote, cold)")
        self.cached_prompt_tokens = m.create_counter("tieredkv.cached_prompt_tokens", unit="{token}",
                                                     description="prompt tokens served from the KV cache")
        self.generated_tokens = m.create_counter("tieredkv.generated_tokens", unit="{token}")
        self.preemptions = m.create_counter("tieredkv.preemptions", unit="{sequence}",
                                            description="preempted sequences, by kind (swap, recompute)")
        # speculative decoding, as vLLM's spec_decode counters
        self.spec_drafts = m.create_counter("tieredkv.spec_decode.num_drafts", unit="{verification}",
                                            description="sequence-steps that verified drafts, by proposer")
        self.spec_draft_tokens = m.create_counter("tieredkv.spec_decode.num_draft_tokens", unit="{token}",
                                                  description="draft tokens verified, by proposer")
        self.spec_accepted_tokens = m.create_counter("tieredkv.spec_decode.num_accepted_tokens", unit="{token}",
                                                     description="draft tokens accepted, by proposer")

        def histogram(name: str, unit: str, buckets: Sequence[float]):
            return m.create_histogram(name, unit=unit, explicit_bucket_boundaries_advisory=buckets)

        self.ttft = histogram("gen_ai.server.time_to_first_token", "s", LATENCY_BUCKETS)
        self.itl = histogram("gen_ai.server.time_per_output_token", "s", TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("gen_ai.server.request.duration", "s", LATENCY_BUCKETS)
        self.queue_time = histogram("tieredkv.request.queue_time", "s", LATENCY_BUCKETS)
        self.step_duration = histogram("tieredkv.step.duration", "s", TOKEN_LATENCY_BUCKETS)
        self.step_tokens = histogram("tieredkv.step.tokens", "{token}", TOKEN_BUCKETS)
        self.engine_id = str(next(_ids))
        if silent:
            return
        _LIVE.add(self)
        with _REGISTERED:
            if not _registered:
                _register_observables(m)
                _registered.append(True)

    # -- another process's records (an engine core in a process of its own: core_process.py) ------------------

    def relay(self, send: Callable[[tuple], None]) -> None:
        """From now on, instruments and request spans record nothing in this process: each record goes to
        `send` as ("metric", instrument, value, attributes) and each span event as ("event", request_id, name,
        attributes), for the application's Telemetry to `replay`; this engine's gauges are the application's
        too (it reads them from the stats the core process sends)."""
        _LIVE.discard(self)
        for name in INSTRUMENTS:
            setattr(self, name, _Relay(name, send))
        self.tracer = _RelayTracer(send)

    def replay(self, record: tuple, spans: dict[str, Any]) -> None:
        """Records what relay() sent in another process: a metric, or an event of one of `spans` (by request id;
        a span already ended takes none)."""
        if record[0] == "metric":
            _, name, value, attrs = record
            instrument = getattr(self, name)
            (instrument.add if hasattr(instrument, "add") else instrument.record)(value, attrs or None)
        else:
            _, request_id, name, attrs = record
            span = spans.get(request_id)
            if span is not None and span.is_recording():
                span.add_event(name, attrs)

    # -- events, on the worker thread -------------------------------------------------------------

    def on_added(self, req) -> None:
        req.arrival_time = time.perf_counter()
        _event(req, "queued", {"tieredkv.prompt_tokens": len(req.prompt_token_ids)})

    def on_admitted(self, seq, now: float) -> None:
        req = seq.request
        if req.admitted_time is None:
            req.admitted_time = now
            self.queue_time.record(now - req.arrival_time)
            _event(req, "admitted", {f"tieredkv.cached_tokens.{t}": n for t, n in req.cached_tokens_by_tier.items()})
            promoted = {f"tieredkv.promoted_tokens.{t}": n for t, n in req.cached_tokens_by_tier.items()
                        if t != "hot" and n}
            if promoted:
                _event(req, "promoted", promoted)
        else:
            _event(req, "resumed", {"tieredkv.sample": seq.index})

    def on_scheduled(self, out, now: float) -> None:
        """A schedule() result: its admitted and preempted sequences."""
        for seq in out.admitted:
            self.on_admitted(seq, now)
        for seq in out.preempted:
            self.on_preempted(seq)

    def on_step(self, out, seconds: float) -> None:
        self.step_duration.record(seconds)
        self.step_tokens.record(out.num_tokens)

    def on_verified(self, proposer: str, drafted: int, accepted: int) -> None:
        """A sequence's drafts were verified: `accepted` of `drafted` taken."""
        attrs = {"proposer": proposer}
        self.spec_drafts.add(1, attrs)
        self.spec_draft_tokens.add(drafted, attrs)
        self.spec_accepted_tokens.add(accepted, attrs)

    def on_preempted(self, seq) -> None:
        kind = "swap" if seq.swapped is not None else "recompute"
        self.preemptions.add(1, {"kind": kind})
        _event(seq.request, "preempted", {"tieredkv.kind": kind, "tieredkv.sample": seq.index})

    def on_token(self, seq, now: float) -> None:
        req = seq.request
        if req.first_token_time is None:
            req.first_token_time = now
            self.ttft.record(now - req.arrival_time)
            _event(req, "first_token", {})
        elif seq.last_token_time is not None:
            self.itl.record(now - seq.last_token_time)
        seq.last_token_time = now

    def on_finished(self, req) -> None:
        reason = next((s.finish_reason for s in req.seqs if s.finish_reason), "stop")
        self.on_ended(req, reason)
        cached = req.cached_tokens_by_tier
        computed = len(req.prompt_token_ids) - sum(cached.values())
        for source, n in (("computed", computed), *cached.items()):
            self.prompt_tokens.add(n, {"source": source})
        self.cached_prompt_tokens.add(req.num_cached_tokens or 0)
        self.generated_tokens.add(sum(s.num_output_tokens for s in req.seqs))
        if req.arrival_time is not None:
            self.e2e.record(time.perf_counter() - req.arrival_time)

    def on_ended(self, req, reason: str) -> None:
        """Counts every request that ends, whatever the reason (the finished ones via on_finished)."""
        self.requests.add(1, {"finish_reason": reason})
        _event(req, "finished" if reason in ("stop", "length", "prefill") else reason, {})

    def on_rejected(self) -> None:
        self.requests.add(1, {"finish_reason": "rejected"})

    def start_request_span(self, request_id: str, params) -> trace.Span:
        """A span from a request's submission to its last chunk (or its abort)."""
        return self.tracer.start_span("tieredkv.request", attributes={
            "tieredkv.request_id": request_id,
            "tieredkv.n": params.n,
            "tieredkv.max_tokens": params.max_tokens,
        })


INSTRUMENTS = ("requests", "prompt_tokens", "cached_prompt_tokens", "generated_tokens", "preemptions", "spec_drafts",
               "spec_draft_tokens", "spec_accepted_tokens", "ttft", "itl", "e2e", "queue_time", "step_duration",
               "step_tokens")


class _Relay:
    """A counter or histogram whose records go to another process (Telemetry.relay)."""

    def __init__(self, name: str, send: Callable[[tuple], None]):
        self.name, self.send = name, send

    def add(self, value, attributes=None) -> None:
        self.send(("metric", self.name, value, attributes))

    record = add


class _RelaySpan:
    """A request's span in the core process: its events go to the application's span of the same request."""

    def __init__(self, request_id: str, send: Callable[[tuple], None]):
        self.request_id, self.send = request_id, send

    def is_recording(self) -> bool:
        return True

    def add_event(self, name: str, attributes=None) -> None:
        self.send(("event", self.request_id, name, attributes or {}))

    def set_attributes(self, attributes) -> None:  # the application's stream sets them on its own span
        pass

    def record_exception(self, exception) -> None:
        pass

    def end(self) -> None:
        pass


class _RelayTracer:
    def __init__(self, send: Callable[[tuple], None]):
        self.send = send

    def start_span(self, name: str, attributes=None) -> _RelaySpan:
        return _RelaySpan((attributes or {}).get("tieredkv.request_id", ""), self.send)


def _event(req, name: str, attributes: dict) -> None:
    span = getattr(req, "span", None)
    if span is not None and span.is_recording():
        span.add_event(name, attributes)


def _register_observables(m) -> None:
    for name, unit in TIER_COUNTERS.items():
        m.create_observable_counter(f"tieredkv.tier.{name}", [_observe(lambda snap, name=name: [
            (getattr(st, name), {"tier": t}) for t, st in snap.tiers.items()])], unit=unit)
    m.create_observable_gauge("tieredkv.kv_cache.usage", [_observe(lambda snap: [
        (st.used_bytes / st.capacity_bytes if st.capacity_bytes else 0.0, {"tier": t})
        for t, st in snap.tiers.items()])], unit="1", description="share of each tier's capacity holding KV data")
    m.create_observable_gauge("tieredkv.kv_cache.used_bytes", [_observe(lambda snap: [
        (st.used_bytes, {"tier": t}) for t, st in snap.tiers.items()])], unit="By")
    m.create_observable_gauge("tieredkv.kv_cache.far_blocks", [_observe(lambda snap: [(snap.blocks_far, {})])],
                              unit="{block}", description="blocks of running sequences kept in the warm tier")
    m.create_observable_counter("tieredkv.kv_cache.offloaded_blocks", [_observe(lambda snap: [
        (snap.blocks_offloaded, {})])], unit="{block}", description="hot blocks moved to the warm tier while in use")
    m.create_observable_counter("tieredkv.prefix_cache.joined_blocks", [_observe(lambda snap: [
        (snap.prefix_blocks_joined, {})])], unit="{block}",
        description="prompt blocks found cached after waiting for the running request that computed them")
    m.create_observable_gauge("tieredkv.kv_cache.bytes_per_token", [_observe(lambda snap: [
        (snap.kv_bytes_per_token, {"format": snap.kv_format})])], unit="By",
        description="one token's K and V over every layer as the cache stores them (format: kv_cache_dtype)")
    for name, field in (("running", "num_running"), ("waiting", "num_waiting"), ("swapped", "num_swapped")):
        m.create_observable_gauge(f"tieredkv.requests.{name}", [_observe(
            lambda snap, field=field: [(getattr(snap, field), {})])], unit="{sequence}")


def _observe(values):
    """A callback: values(snapshot) -> [(value, attributes)] for every live engine that has stats."""
    def callback(_options):
        return [Observation(v, {**attrs, "engine": t.engine_id})
                for t in list(_LIVE) if t.snapshot is not None for v, attrs in values(t.snapshot)]
    return callback


def install_prometheus() -> bool:
    """Exports the engine's OpenTelemetry metrics in Prometheus' format (the `prometheus` extra). Sets
    the process's meter provider, so call it once, before the engine starts; False without the extra."""
    try:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from opentelemetry.sdk.metrics import MeterProvider
    except ImportError:
        return False
    metrics.set_meter_provider(MeterProvider(metric_readers=[PrometheusMetricReader()]))
    return True


def serve_metrics(port: int, addr: str = "127.0.0.1") -> int:
    """install_prometheus(), then /metrics over HTTP on addr:port (0: any free port) from a daemon
    thread; returns the port. For an application that embeds the engine without `tieredkv serve`."""
    if not install_prometheus():
        raise ImportError("serving metrics needs the prometheus extra: pip install 'tieredkv[prometheus]'")
    from prometheus_client import start_http_server

    server, _ = start_http_server(port, addr)
    return server.server_port
