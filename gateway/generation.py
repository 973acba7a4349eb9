"""What chat and text completions share: the engine's sampling settings from the request, the
receipt that records them, the engine run that fills the receipt, and the response -- one JSON
body, or server-sent chunks. The two routes differ only in their prompt and in the shape of a
choice (`ResponseShape`)."""

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from engine import EngineOverloaded, InvalidRequest, RequestOutput, SamplingParams
from gateway import sse
from gateway.auth import Principal
from gateway.errors import APIError
from gateway.schemas import GenerationRequest
from gateway.services import PreparedPrompt, Services
from gateway.tracing import record_trace
from provenance.memory import TEMPLATE_VERSION
from provenance.receipt_writer import ReceiptNotCommitted
from provenance.receipts import ReceiptRecord, new_receipt_id

log = logging.getLogger("inherent.generation")


def check_model(services: Services, body: GenerationRequest) -> None:
    if body.model not in services.served_model_names:
        raise APIError(
            404,
            f"the model '{body.model}' does not exist; this server serves '{services.model_id}'",
            param="model",
            code="model_not_found",
        )


async def within_quota(
    request: Request, principal: Principal, answer: Callable[[], Awaitable[Any]]
) -> Any:
    """Run `answer` inside the tenant's quota slot; a stream holds it until it ends."""
    slot = await request.app.state.quotas.admit(principal.tenant_id)
    try:
        response = await answer()
    except BaseException:
        await slot.release()
        raise
    if isinstance(response, StreamingResponse):
        response.background = BackgroundTask(slot.release)  # runs when the stream ends
    else:
        await slot.release()
    return response


def sampling_params(
    body: GenerationRequest, prompt_len: int, max_model_len: int, prompt_param: str,
    tenant_id: str,
) -> SamplingParams:
    """The engine's settings for this request; its prefix cache is salted with the tenant, so
    tenants never share cached KV (nor learn from hits what another tenant sent)."""
    room = max_model_len - prompt_len
    if room < 1:
        raise APIError(
            400,
            f"the prompt is {prompt_len} tokens (with any retrieved context); the model's context window is {max_model_len} tokens",
            param=prompt_param,
            code="context_length_exceeded",
        )
    asked = body.asked_max_tokens
    if asked is not None and asked > room:
        raise APIError(
            400,
            f"max_tokens {asked} exceeds the {room} tokens left in the context window",
            param="max_tokens",
            code="context_length_exceeded",
        )
    try:
        return SamplingParams(
            max_tokens=asked or min(512, room),
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed,
            stop=list(body.stop or []),
            ignore_eos=body.ignore_eos,
            repetition_penalty=body.repetition_penalty,
            frequency_penalty=body.frequency_penalty,
            presence_penalty=body.presence_penalty,
            min_tokens=body.min_tokens,
            logit_bias=dict(body.logit_bias or {}),
            logprobs=body.num_logprobs,
            cache_salt=tenant_id,
        )
    except ValueError as exc:
        raise APIError(400, str(exc), code="invalid_value") from exc


def receipt_sampling(params: SamplingParams) -> dict[str, Any]:
    """Every SamplingParams field, so replay rebuilds the same settings (`SamplingParams(**d)`);
    logit_bias keys as strings, as JSON will store them anyway (the audit hash sees the same)."""
    sampling = dataclasses.asdict(params)
    sampling["logit_bias"] = {str(t): b for t, b in params.logit_bias.items()}
    return sampling


def new_record(
    services: Services,
    principal: Principal,
    prompt: PreparedPrompt,
    params: SamplingParams,
    request_id: str | None,
    messages: list[dict[str, Any]] | None = None,
    completion_prompt: str | list[int] | None = None,
) -> ReceiptRecord:
    """A chat receipt (`messages`) or a text completion one (`completion_prompt`)."""
    return ReceiptRecord(
        receipt_id=new_receipt_id(),
        tenant_id=principal.tenant_id,
        api_key_id=principal.key_id,
        model_id=services.model_id,
        weights_hash=services.weights_hash,
        messages=messages or [],
        sampling=receipt_sampling(params),
        engine=services.engine_numerics,
        retrieval=prompt.retrieval.record(prompt.chunks) if prompt.retrieval else None,
        prompt_text=prompt.prompt_text,
        prompt_token_count=len(prompt.prompt_ids),
        template_version=TEMPLATE_VERSION if messages is not None else "none",
        operation="chat" if messages is not None else "text_completion",
        completion_prompt=completion_prompt,
        request_id=request_id,
    )


async def run_engine(
    services: Services, record: ReceiptRecord, prompt: PreparedPrompt, params: SamplingParams
) -> AsyncIterator[RequestOutput]:
    """Stream engine outputs while filling the receipt. The receipt is always written, off the
    event loop (then the request's trace); the stream ends only once it is committed
    (ReceiptNotCommitted if it cannot be)."""
    start = time.perf_counter()
    engine_started_ns = time.time_ns()
    try:
        async for out in services.engine.generate(prompt.prompt_ids, params, record.receipt_id):
            record.output_text += out.text
            record.output_token_ids.extend(out.token_ids)
            if out.finished:
                record.finish_reason = out.finish_reason.value
                record.timeline = out.metrics.to_dict() if out.metrics else {}
                if out.error is not None:
                    raise GenerationFailed(out.error)
            yield out
            # While the engine computes the next token: the receipt's request part, which the
            # receipt write would otherwise serialize after the answer's last token.
            record.serialize_request()
    except (EngineOverloaded, InvalidRequest):
        raise  # refused before any work: the client gets a 4xx, there is nothing to audit
    except (GeneratorExit, asyncio.CancelledError):
        # The client went away: leaving generate() aborted the engine request (its KV blocks are
        # freed at the next step). The receipt is committed without waiting: nobody reads it.
        record.error = {"type": "cancelled", "message": "the client went away mid-answer"}
        record.finish_reason = record.finish_reason or "abort"
        services.receipts.submit(record)
        services.metrics.receipts.labels(record.status).inc()
        raise
    except Exception as exc:
        # A failure mid-generation is reported only once its receipt is committed. The receipt
        # names the kind of failure, never the exception's text (SECURITY.md).
        if isinstance(exc, GenerationFailed):
            record.error = {"type": "generation_failed", "message": str(exc)}
        else:
            log.error("generation failed for receipt %s", record.receipt_id, exc_info=exc)
            record.error = {"type": "generation_failed", "message": "the engine failed"}
        record.finish_reason = record.finish_reason or "abort"
        receipt_started_ns = time.time_ns()
        await services.receipts.write(record)
        services.metrics.receipts.labels(record.status).inc()
        record_trace(services.tracer, record, prompt.timings.started_ns, prompt.timings,
                     engine_started_ns, receipt_started_ns, time.time_ns())
        raise
    if record.finish_reason == "abort":
        record.error = {"type": "aborted", "message": "the engine aborted the request"}
    prompt.timings.engine = time.perf_counter() - start
    receipt_started_ns = time.time_ns()
    await services.receipts.write(record)
    services.metrics.receipts.labels(record.status).inc()
    receipt_ended_ns = time.time_ns()
    prompt.timings.receipt = (receipt_ended_ns - receipt_started_ns) / 1e9
    log.info(
        "%s %s: %d prompt + %d output tokens, finish %s",
        record.operation, record.receipt_id, record.prompt_token_count,
        len(record.output_token_ids), record.finish_reason,
    )
    record_trace(services.tracer, record, prompt.timings.started_ns, prompt.timings,
                 engine_started_ns, receipt_started_ns, receipt_ended_ns)


class ResponseShape(Protocol):
    """How one kind of completion writes its objects."""

    id_prefix: str
    object_name: str  # of the whole response
    chunk_object: str  # of a streamed chunk
    opening: dict[str, Any] | None  # a streamed choice before any token (chat's role delta)

    def choice(self, text: str, logprobs: list | None, final: bool) -> dict[str, Any]:
        """A choice holding `text` and the `logprobs` entries of its tokens (None: not asked);
        `final`: the whole answer of a non-streamed response."""
        ...


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class GenerationFailed(RuntimeError):
    """This request alone failed in the engine; its message is safe to show the client."""


def generation_error(record: ReceiptRecord, exc: Exception) -> APIError:
    """What the client is told when generating its answer failed with ``exc``. Fail closed: an
    answer whose receipt is not committed is not returned, and no receipt is named; any other
    failure is recorded by the receipt it names."""
    if isinstance(exc, ReceiptNotCommitted):
        status, code, headers = 503, "receipt_not_committed", {"Retry-After": "2"}
        message = (
            f"the answer was not returned because its receipt could not be committed ({exc}); "
            "retry"
        )
    else:
        status, code, headers = 500, "generation_failed", {"X-Receipt-Id": record.receipt_id}
        message = f"generation failed; the receipt {record.receipt_id} records it"
    return APIError(status, message, type="server_error", code=code, headers=headers)


async def drain_unless_gone(stream: AsyncIterator[Any], request: Request) -> tuple[list, bool]:
    """Run a non-streaming generation to its end, or cancel it when the client disconnects
    first (True then): the engine aborts the request and frees its KV blocks, and the receipt
    says cancelled. Returns the outputs; raises what the generation raises
    (ReceiptNotCommitted among them)."""
    generation = asyncio.ensure_future(_collect(stream))
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({generation, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        gone = not generation.done()
        if gone:
            generation.cancel()
            await asyncio.wait({generation})
    return ([] if gone else generation.result()), gone


async def _collect(stream: AsyncIterator[Any]) -> list:
    return [out async for out in stream]


async def _disconnected(request: Request) -> None:
    # The body is read: the server's next message for this request is its disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def respond(
    services: Services,
    request: Request,
    principal: Principal,
    body: GenerationRequest,
    prompt: PreparedPrompt,
    shape: ResponseShape,
    prompt_param: str,
    messages: list[dict[str, Any]] | None = None,
    completion_prompt: str | list[int] | None = None,
) -> JSONResponse | StreamingResponse:
    """Run the request on its prepared prompt and answer it in `shape`: one body, or SSE chunks
    when streaming. `prompt_param` names the request field a too-long prompt came from; the
    receipt records `messages` (chat) or `completion_prompt` (text completion)."""
    params = sampling_params(
        body, len(prompt.prompt_ids), services.max_model_len, prompt_param, principal.tenant_id
    )
    record = new_record(services, principal, prompt, params, request.state.request_id,
                        messages=messages, completion_prompt=completion_prompt)
    if body.top_k > services.tokenizer.vocab_size:
        raise APIError(
            400,
            f"top_k must be at most the vocabulary size, {services.tokenizer.vocab_size}",
            param="top_k",
            code="invalid_value",
        )
    citations = [c.citation() for c in prompt.chunks]
    created = int(time.time())
    headers = {"X-Receipt-Id": record.receipt_id}
    stream = run_engine(services, record, prompt, params)
    try:
        first = await anext(stream)
    except StopAsyncIteration:
        first = None
    except (EngineOverloaded, InvalidRequest) as exc:
        overloaded = isinstance(exc, EngineOverloaded)
        raise APIError(
            429 if overloaded else 400,
            str(exc),
            type="rate_limit_error" if overloaded else "invalid_request_error",
            code="engine_overloaded" if overloaded else "invalid_value",
            headers={"Retry-After": "1"} if overloaded else None,
        ) from exc
    except Exception as exc:
        raise generation_error(record, exc) from exc
    header = {
        "id": f"{shape.id_prefix}-{record.receipt_id}",
        "created": created,
        "model": services.model_id,
    }
    prompt_tokens = len(prompt.prompt_ids)
    if not body.stream:
        outputs = [first] if first is not None else []
        if first is not None:  # run to the end, whose receipt write follows the last output
            try:
                rest, gone = await drain_unless_gone(stream, request)
            except Exception as exc:
                raise generation_error(record, exc) from exc
            if gone:  # nobody reads this; it keeps the access log and metrics honest
                return APIError(
                    499, "client closed request", type="cancelled",
                    code="client_closed_request", headers=headers,
                ).response()
            outputs += rest
        logprobs = None
        if params.logprobs is not None:
            logprobs = [entry for out in outputs for entry in out.logprobs or []]
        completion = {
            **header,
            "object": shape.object_name,
            "choices": [
                {
                    **shape.choice(record.output_text, logprobs, final=True),
                    "finish_reason": record.finish_reason,
                }
            ],
            "usage": usage(prompt_tokens, len(record.output_token_ids)),
            "citations": citations,
            "receipt_id": record.receipt_id,
        }
        return JSONResponse(
            completion, headers={**headers, "Server-Timing": prompt.timings.header()}
        )
    options = body.stream_options
    return StreamingResponse(
        sse_events(
            stream,
            first,
            record,
            shape,
            header,
            citations,
            prompt_tokens,
            include_usage=bool(options and options.include_usage),
            continuous_usage=bool(options and options.include_usage and options.continuous_usage_stats),
        ),
        media_type="text/event-stream",
        headers={**headers, "Cache-Control": "no-cache"},
    )


async def sse_events(
    stream: AsyncIterator[RequestOutput],
    first: RequestOutput | None,
    record: ReceiptRecord,
    shape: ResponseShape,
    header: dict[str, Any],
    citations: list,
    prompt_tokens: int,
    include_usage: bool,
    continuous_usage: bool,
) -> AsyncIterator[str]:
    def chunk(choice: dict | None, finish_reason: str | None = None, **extra: Any) -> str:
        choices = [{**choice, "finish_reason": finish_reason}] if choice is not None else []
        if continuous_usage:  # vLLM's continuous_usage_stats: the usage so far on every chunk
            extra.setdefault("usage", usage(prompt_tokens, len(record.output_token_ids)))
        return sse.event({**header, "object": shape.chunk_object, "choices": choices, **extra})

    if shape.opening is not None:
        yield chunk(shape.opening)
    try:
        outputs = [first] if first is not None else []
        async for out in _chain(outputs, stream):
            if out.text or out.logprobs:
                yield chunk(shape.choice(out.text, out.logprobs, final=False))
    except Exception as exc:
        error = generation_error(record, exc)
        # Only a committed receipt is named: fail closed when there is none.
        committed = not isinstance(exc, ReceiptNotCommitted)
        yield sse.event({**error.body(), **({"receipt_id": record.receipt_id} if committed else {})})
        yield sse.event(sse.DONE)
        return
    yield chunk(
        shape.choice("", None, final=False),
        record.finish_reason,
        citations=citations,
        receipt_id=record.receipt_id,
    )
    if include_usage:
        yield chunk(
            None,
            usage=usage(prompt_tokens, len(record.output_token_ids)),
            citations=citations,
            receipt_id=record.receipt_id,
        )
    yield sse.event(sse.DONE)


async def _chain(head: list, tail: AsyncIterator) -> AsyncIterator:
    for item in head:
        yield item
    async for item in tail:
        yield item


def token_text(services: Services, token_id: int) -> str:
    """A token as text (its special-token text included): what logprobs entries name."""
    return services.tokenizer.decode([token_id], skip_special_tokens=False)
