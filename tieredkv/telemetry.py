"""OpenTelemetry tracing and metrics through the global providers: nothing is recorded or exported
unless the application installs SDK providers (opentelemetry-sdk) with an exporter or reader."""

from __future__ import annotations

from opentelemetry import metrics, trace

_SCOPE = "tieredkv"


class Telemetry:
    """Per-engine instruments: one span per request, counters and a step-duration histogram."""

    def __init__(self) -> None:
        self.tracer = trace.get_tracer(_SCOPE)
        meter = metrics.get_meter(_SCOPE)
        self.requests = meter.create_counter("tieredkv.requests", unit="{request}", description="requests finished")
        self.prompt_tokens = meter.create_counter("tieredkv.prompt_tokens", unit="{token}")
        self.cached_prompt_tokens = meter.create_counter(
            "tieredkv.cached_prompt_tokens", unit="{token}", description="prompt tokens served from the KV cache"
        )
        self.generated_tokens = meter.create_counter("tieredkv.generated_tokens", unit="{token}")
        self.preemptions = meter.create_counter("tieredkv.preemptions", unit="{sequence}")
        self.step_duration = meter.create_histogram("tieredkv.step.duration", unit="s")
        self.step_tokens = meter.create_histogram("tieredkv.step.tokens", unit="{token}")

    def record_finished(self, req) -> None:
        self.requests.add(1)
        self.prompt_tokens.add(len(req.prompt_token_ids))
        self.cached_prompt_tokens.add(req.num_cached_tokens or 0)
        self.generated_tokens.add(sum(s.num_output_tokens for s in req.seqs))

    def start_request_span(self, request_id: str, params) -> trace.Span:
        """A span from a request's submission to its last chunk (or its abort)."""
        return self.tracer.start_span("tieredkv.request", attributes={
            "tieredkv.request_id": request_id,
            "tieredkv.n": params.n,
            "tieredkv.max_tokens": params.max_tokens,
        })
