"""OpenAI-compatible chat completions, grounded in pinned retrieval, each leaving a receipt."""

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from engine import EngineOverloaded, InvalidRequest, SamplingParams
from engine.tokenizer import UnsafeContent
from gateway.auth import Principal
from gateway.deps import ChatPrincipal, ServicesDep
from gateway.errors import APIError
from gateway.schemas import ChatCompletion, ChatCompletionRequest, ModelCard, ModelList
from gateway.services import PreparedPrompt, Services
from provenance.db import session_scope
from provenance.memory import TEMPLATE_VERSION, UnknownSnapshot
from provenance.receipt_writer import ReceiptNotCommitted
from provenance.receipts import ReceiptRecord, new_receipt_id

router = APIRouter(tags=["chat"])
log = logging.getLogger("inherent.chat")


@router.get("/v1/models", response_model=ModelList)
def list_models(services: ServicesDep, _: ChatPrincipal) -> ModelList:
    return ModelList(
        data=[ModelCard(id=services.model_id, created=0, weights_hash=services.weights_hash)]
    )


def sampling_params(
    body: ChatCompletionRequest, prompt_len: int, max_model_len: int, tenant_id: str
) -> SamplingParams:
    """The engine's settings for this request; its prefix cache is salted with the tenant, so
    tenants never share cached KV (nor learn from hits what another tenant sent)."""
    room = max_model_len - prompt_len
    if room < 1:
        raise APIError(
            400,
            f"the prompt is {prompt_len} tokens with its retrieved context; the model's context window is {max_model_len} tokens",
            param="messages",
            code="context_length_exceeded",
        )
    asked = body.max_completion_tokens or body.max_tokens
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
            cache_salt=tenant_id,
        )
    except ValueError as exc:
        raise APIError(400, str(exc), code="invalid_value") from exc


def prepare(
    services: Services, principal: Principal, body: ChatCompletionRequest
) -> PreparedPrompt:
    messages = [m.model_dump() for m in body.messages]
    with session_scope(services.settings.sqlalchemy_url) as session:
        try:
            return services.prepare(
                session,
                principal.tenant_id,
                messages,
                body.inherent.retrieval,
                body.inherent.snapshot,
                body.inherent.top_k,
            )
        except UnknownSnapshot as exc:
            raise APIError(
                400, str(exc), param="inherent.snapshot", code="unknown_snapshot"
            ) from exc
        except UnsafeContent as exc:
            raise APIError(400, str(exc), param="messages", code="invalid_content") from exc


def new_record(
    services: Services,
    principal: Principal,
    body: ChatCompletionRequest,
    prompt: PreparedPrompt,
    params: SamplingParams,
) -> ReceiptRecord:
    return ReceiptRecord(
        receipt_id=new_receipt_id(),
        tenant_id=principal.tenant_id,
        api_key_id=principal.key_id,
        model_id=services.model_id,
        weights_hash=services.weights_hash,
        messages=[m.model_dump() for m in body.messages],
        sampling={
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "max_tokens": params.max_tokens,
            "seed": params.seed,
            "stop": list(params.stop),
        },
        engine=services.engine_numerics,
        retrieval=prompt.retrieval.record(prompt.chunks) if prompt.retrieval else None,
        prompt_text=prompt.prompt_text,
        prompt_token_count=len(prompt.prompt_ids),
        template_version=TEMPLATE_VERSION,
    )


async def run_engine(
    services: Services, record: ReceiptRecord, prompt: PreparedPrompt, params: SamplingParams
) -> AsyncIterator[Any]:
    """Stream engine outputs while filling the receipt. The receipt is always written, off the
    event loop; the stream ends only once it is committed (ReceiptNotCommitted if it cannot be)."""
    start = time.perf_counter()
    try:
        async for out in services.engine.generate(prompt.prompt_ids, params, record.receipt_id):
            record.output_text += out.text
            record.output_token_ids.extend(out.token_ids)
            if out.finished:
                record.finish_reason = out.finish_reason
                record.timeline = out.metrics or {}
                if out.error is not None:
                    raise GenerationFailed(out.error)
            yield out
    except (EngineOverloaded, InvalidRequest):
        raise  # refused before any work: the client gets a 4xx, there is nothing to audit
    except (GeneratorExit, asyncio.CancelledError):
        # The client went away: leaving generate() aborted the engine request (its KV blocks are
        # freed at the next step). The receipt is committed without waiting: nobody reads it.
        record.error = {"type": "cancelled", "message": "the client went away mid-answer"}
        record.finish_reason = record.finish_reason or "abort"
        services.receipts.submit(record)
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
        await services.receipts.write(record)
        raise
    if record.finish_reason == "abort":
        record.error = {"type": "aborted", "message": "the engine aborted the request"}
    prompt.timings.engine = time.perf_counter() - start
    start = time.perf_counter()
    await services.receipts.write(record)
    prompt.timings.receipt = time.perf_counter() - start


def receipt_unavailable(exc: ReceiptNotCommitted) -> APIError:
    """Fail closed: an answer whose receipt is not committed is not returned."""
    return APIError(
        503,
        "the answer was not returned because its receipt could not be committed; retry",
        type="server_error",
        code="receipt_not_committed",
        headers={"Retry-After": "2"},
    )


async def drain_unless_gone(stream: AsyncIterator[Any], request: Request) -> bool:
    """Run a non-streaming generation to its end, or cancel it when the client disconnects
    first (True then): the engine aborts the request and frees its KV blocks, and the receipt
    says cancelled. Raises what the generation raises (ReceiptNotCommitted among them)."""
    generation = asyncio.ensure_future(_consume(stream))
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({generation, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        gone = not generation.done()
        if gone:
            generation.cancel()
            await asyncio.wait({generation})
    if not gone:
        generation.result()
    return gone


async def _consume(stream: AsyncIterator[Any]) -> None:
    async for _ in stream:
        pass


async def _disconnected(request: Request) -> None:
    # The body is read: the server's next message for this request is its disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


class GenerationFailed(RuntimeError):
    """This request alone failed in the engine; its message is safe to show the client."""


def failure(record: ReceiptRecord) -> APIError:
    return APIError(
        500,
        f"generation failed; the receipt {record.receipt_id} records it",
        type="server_error",
        code="generation_failed",
        headers={"X-Receipt-Id": record.receipt_id},
    )


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(
    request: Request, body: ChatCompletionRequest, services: ServicesDep, principal: ChatPrincipal
) -> Any:
    if body.model not in services.served_model_names:
        raise APIError(
            404,
            f"the model '{body.model}' does not exist; this server serves '{services.model_id}'",
            param="model",
            code="model_not_found",
        )
    slot = await request.app.state.quotas.admit(principal.tenant_id)
    try:
        response = await complete(request, body, services, principal)
    except BaseException:
        await slot.release()
        raise
    if isinstance(response, StreamingResponse):
        response.background = BackgroundTask(slot.release)  # runs when the stream ends
    else:
        await slot.release()
    return response


async def complete(
    request: Request, body: ChatCompletionRequest, services: Services, principal: Principal
) -> JSONResponse | StreamingResponse:
    if body.top_k > services.tokenizer.vocab_size:
        raise APIError(
            400,
            f"top_k must be at most the vocabulary size, {services.tokenizer.vocab_size}",
            param="top_k",
            code="invalid_value",
        )
    prompt = await run_in_threadpool(prepare, services, principal, body)
    params = sampling_params(
        body, len(prompt.prompt_ids), services.max_model_len, principal.tenant_id
    )
    record = new_record(services, principal, body, prompt, params)
    citations = [c.citation() for c in prompt.chunks]
    created = int(time.time())
    headers = {"X-Receipt-Id": record.receipt_id}
    stream = run_engine(services, record, prompt, params)
    try:
        first = await anext(stream)
    except StopAsyncIteration:
        first = None
    except ReceiptNotCommitted as exc:
        raise receipt_unavailable(exc) from exc
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
        raise failure(record) from exc

    if not body.stream:
        if first is not None:
            try:
                gone = await drain_unless_gone(stream, request)
            except ReceiptNotCommitted as exc:
                raise receipt_unavailable(exc) from exc
            except Exception as exc:
                raise failure(record) from exc
            if gone:  # nobody reads this; it keeps the access log and metrics honest
                return APIError(
                    499, "client closed request", type="cancelled",
                    code="client_closed_request", headers=headers,
                ).response()
        completion = ChatCompletion(
            id=f"chatcmpl-{record.receipt_id}",
            created=created,
            model=services.model_id,
            choices=[
                {
                    "message": {"role": "assistant", "content": record.output_text},
                    "finish_reason": record.finish_reason,
                }
            ],
            usage={
                "prompt_tokens": len(prompt.prompt_ids),
                "completion_tokens": len(record.output_token_ids),
                "total_tokens": len(prompt.prompt_ids) + len(record.output_token_ids),
            },
            citations=citations,
            receipt_id=record.receipt_id,
        )
        return JSONResponse(
            completion.model_dump(), headers={**headers, "Server-Timing": prompt.timings.header()}
        )

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return StreamingResponse(
        sse_events(
            stream,
            first,
            record,
            services.model_id,
            created,
            citations,
            include_usage,
            len(prompt.prompt_ids),
        ),
        media_type="text/event-stream",
        headers={**headers, "Cache-Control": "no-cache"},
    )


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def sse_events(
    stream,
    first,
    record: ReceiptRecord,
    model: str,
    created: int,
    citations: list,
    include_usage: bool,
    prompt_tokens: int,
) -> AsyncIterator[str]:
    chunk_id = f"chatcmpl-{record.receipt_id}"

    def chunk(delta: dict, finish_reason: str | None = None, **extra: Any) -> str:
        return sse(
            {
                "id": chunk_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
                **extra,
            }
        )

    yield chunk({"role": "assistant", "content": ""})
    try:
        outputs = [first] if first is not None else []
        async for out in _chain(outputs, stream):
            if out.text:
                yield chunk({"content": out.text})
    except Exception as exc:
        committed = not isinstance(exc, ReceiptNotCommitted)
        error = failure(record) if committed else receipt_unavailable(exc)
        yield sse(
            {
                "error": {
                    "message": error.message,
                    "type": error.type,
                    "param": None,
                    "code": error.code,
                },
                # Only a committed receipt is named: fail closed when there is none.
                **({"receipt_id": record.receipt_id} if committed else {}),
            }
        )
        yield "data: [DONE]\n\n"
        return
    yield chunk({}, record.finish_reason, citations=citations, receipt_id=record.receipt_id)
    if include_usage:
        completion_tokens = len(record.output_token_ids)
        yield sse(
            {
                "id": chunk_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                },
                "citations": citations,
                "receipt_id": record.receipt_id,
            }
        )
    yield "data: [DONE]\n\n"


async def _chain(head: list, tail: AsyncIterator) -> AsyncIterator:
    for item in head:
        yield item
    async for item in tail:
        yield item
