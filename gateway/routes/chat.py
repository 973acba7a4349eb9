"""OpenAI-compatible chat completions, grounded in pinned retrieval, each leaving a receipt."""

from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from engine.tokenizer import UnsafeContent
from gateway.auth import Principal
from gateway.deps import ChatPrincipal, ServicesDep
from gateway.errors import APIError
from gateway.generation import (
    check_model,
    respond,
    token_text,
    within_quota,
)
from gateway.schemas import ChatCompletionRequest, ModelCard, ModelList
from gateway.services import PreparedPrompt, Services
from provenance.db import get_engine
from provenance.memory import UnknownSnapshot

router = APIRouter(tags=["chat"])


@router.get("/v1/models", response_model=ModelList)
def list_models(services: ServicesDep, _: ChatPrincipal) -> ModelList:
    return ModelList(
        data=[
            ModelCard(id=services.model_id, created=0, weights_hash=services.weights_hash),
            ModelCard(
                id=services.embedding_model_name,
                created=0,
                weights_hash=services.embedder.model_id.partition("@")[2],
            ),
        ]
    )


def prepare(
    services: Services, principal: Principal, body: ChatCompletionRequest
) -> PreparedPrompt:
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    # A plain connection, not a Session: the snapshot and the visibility check read in its one
    # transaction, with no unit of work to set up and commit around them.
    with get_engine(services.settings.sqlalchemy_url).connect() as connection:
        try:
            return services.prepare(
                connection,
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


@dataclass
class ChatShape:
    services: Services
    id_prefix: str = "chatcmpl"
    object_name: str = "chat.completion"
    chunk_object: str = "chat.completion.chunk"
    opening: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.opening = {"index": 0, "delta": {"role": "assistant", "content": ""}}

    def choice(self, text: str, logprobs: list | None, final: bool) -> dict[str, Any]:
        if final:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "delta": {"content": text} if text else {}}
        if logprobs is not None:
            choice["logprobs"] = {"content": [self.entry(*e) for e in logprobs]}
        return choice

    def entry(self, token: int, logprob: float, top: list[tuple[int, float]]) -> dict[str, Any]:
        def item(token_id: int, value: float) -> dict[str, Any]:
            text = token_text(self.services, token_id)
            return {"token": text, "logprob": value, "bytes": list(text.encode())}

        return {**item(token, logprob), "top_logprobs": [item(t, v) for t, v in top]}


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, services: ServicesDep, principal: ChatPrincipal
) -> Any:
    check_model(services, body)

    async def answer():
        prompt = await run_in_threadpool(prepare, services, principal, body)
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        return await respond(services, request, principal, body, prompt, ChatShape(services),
                             "messages", messages=messages)

    return await within_quota(request, principal, answer)
