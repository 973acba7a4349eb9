"""OpenAI's legacy text completions: the prompt (text or token ids) goes to the model as it is,
without retrieval or chat template, and leaves a receipt like a chat answer."""

from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from gateway.deps import ChatPrincipal, ServicesDep
from gateway.errors import APIError
from gateway.generation import (
    check_model,
    respond,
    token_text,
    within_quota,
)
from gateway.schemas import CompletionRequest
from gateway.services import Services

router = APIRouter(tags=["completions"])


@dataclass
class CompletionShape:
    services: Services
    echo: str | None  # the prompt's text, when the request asks for it back
    id_prefix: str = "cmpl"
    object_name: str = "text_completion"
    chunk_object: str = "text_completion"
    opening: dict[str, Any] | None = None
    offset: int = 0  # text_offset of the next token's text in the whole returned text

    def __post_init__(self) -> None:
        if self.echo is not None:  # streamed: the prompt comes first, in a chunk of its own
            self.opening = {"index": 0, "text": self.echo, "logprobs": None}
            self.offset = len(self.echo)

    def choice(self, text: str, logprobs: list | None, final: bool) -> dict[str, Any]:
        if final and self.echo is not None:
            text = self.echo + text
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None}
        if logprobs:
            tokens = [token_text(self.services, token) for token, _, _ in logprobs]
            offsets = []
            for token in tokens:
                offsets.append(self.offset)
                self.offset += len(token)
            choice["logprobs"] = {
                "tokens": tokens,
                "token_logprobs": [value for _, value, _ in logprobs],
                "top_logprobs": [
                    {token_text(self.services, t): v for t, v in top} for _, _, top in logprobs
                ],
                "text_offset": offsets,
            }
        return choice


@router.post("/v1/completions", response_model=None)
async def completions(
    body: CompletionRequest, request: Request, services: ServicesDep, principal: ChatPrincipal
) -> Any:
    check_model(services, body)
    if body.echo and body.logprobs is not None:
        raise APIError(
            400,
            "echo with logprobs would need the prompt's logprobs, which this server does not compute",
            param="echo",
            code="unsupported_value",
        )

    async def answer():
        try:
            prompt = await run_in_threadpool(services.completion_prompt, body.prompt)
        except ValueError as exc:
            raise APIError(400, str(exc), param="prompt", code="invalid_value") from exc
        shape = CompletionShape(services, prompt.prompt_text if body.echo else None)
        return await respond(services, request, principal, body, prompt, shape, "prompt",
                             completion_prompt=body.prompt)

    return await within_quota(request, principal, answer)
