"""OpenTelemetry traces, off unless configured (`INHERENT_OTEL_ENDPOINT`, OTLP over HTTP).

One trace per generation: a root span named as the GenAI semantic conventions name it
("chat {model}", "text_completion {model}"), with children for retrieval, queue, prefill, decode
and the receipt write. They are written when the receipt is, from the times the request
recorded (the engine's timeline, the gateway's timings), so the engine thread needs no tracing.
The root span carries the receipt id (`gen_ai.response.id`) and the request id, so a receipt
and its trace join on either.
"""

from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Tracer

from provenance.receipts import ReceiptRecord

NS = 1_000_000_000


def tracer_provider_for(endpoint: str):
    """An SDK provider exporting to `endpoint` in batches; None (no tracing) when empty."""
    if not endpoint:
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": "inherent"}))
    exporter = OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces")
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def get_tracer(provider) -> Tracer:
    return provider.get_tracer("inherent") if provider is not None else trace.NoOpTracer()


def record_trace(
    tracer: Tracer,
    record: ReceiptRecord,
    started_ns: int,
    timings: Any,  # gateway.services.Timings
    engine_started_ns: int,
    receipt_started_ns: int,
    receipt_ended_ns: int,
) -> None:
    """Write the request's spans, laid out from what it recorded."""
    sampling = record.sampling
    attributes = {
        "gen_ai.operation.name": record.operation,
        "gen_ai.provider.name": "inherent",
        "gen_ai.request.model": record.model_id,
        "gen_ai.request.temperature": sampling["temperature"],
        "gen_ai.request.top_p": sampling["top_p"],
        "gen_ai.request.top_k": sampling["top_k"],
        "gen_ai.request.max_tokens": sampling["max_tokens"],
        "gen_ai.request.presence_penalty": sampling["presence_penalty"],
        "gen_ai.request.frequency_penalty": sampling["frequency_penalty"],
        "gen_ai.response.id": record.receipt_id,
        "gen_ai.response.model": record.model_id,
        "gen_ai.response.finish_reasons": [record.finish_reason or "error"],
        "gen_ai.usage.input_tokens": record.prompt_token_count,
        "gen_ai.usage.output_tokens": len(record.output_token_ids),
        "inherent.receipt_id": record.receipt_id,
        "inherent.request.id": record.request_id or "",
        "inherent.tenant_id": record.tenant_id,
    }
    if sampling.get("seed") is not None:
        attributes["gen_ai.request.seed"] = sampling["seed"]
    if record.error:
        attributes["error.type"] = record.error["type"]
    root = tracer.start_span(
        f"{record.operation} {record.model_id}",
        kind=SpanKind.SERVER,
        start_time=started_ns,
        attributes=attributes,
    )
    context = trace.set_span_in_context(root)
    ids = {"inherent.receipt_id": record.receipt_id, "gen_ai.response.id": record.receipt_id}

    def child(name: str, start: int, end: int, **extra: Any) -> None:
        span = tracer.start_span(name, context=context, start_time=start,
                                 attributes={**ids, **extra})
        span.end(end_time=max(start, end))

    if record.retrieval is not None:
        end = started_ns + int((timings.embed + timings.retrieve) * NS)
        child("retrieval", started_ns, end,
              **{"inherent.retrieval.snapshot_epoch": record.retrieval["snapshot_epoch"],
                 "inherent.retrieval.chunks": len(record.retrieval["chunks"]),
                 "inherent.retrieval.embedding_model": record.retrieval["embedding_model"]})
    timeline = record.timeline
    queue = timeline.get("queue_time")
    ttft = timeline.get("ttft")
    if queue is not None:
        child("queue", engine_started_ns, engine_started_ns + int(queue * NS))
        if ttft is not None:
            child("prefill", engine_started_ns + int(queue * NS),
                  engine_started_ns + int(ttft * NS),
                  **{"gen_ai.usage.input_tokens": record.prompt_token_count,
                     "inherent.cached_tokens": timeline.get("num_cached_tokens") or 0})
    if ttft is not None and timeline.get("decode_time") is not None:
        first = engine_started_ns + int(ttft * NS)
        child("decode", first, first + int(timeline["decode_time"] * NS),
              **{"gen_ai.usage.output_tokens": len(record.output_token_ids),
                 "inherent.interference_steps": timeline.get("interference_steps") or 0})
    child("receipt.write", receipt_started_ns, receipt_ended_ns)
    root.end(end_time=receipt_ended_ns)
