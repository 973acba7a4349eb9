"""vLLM's /tokenize and /detokenize, on the chat model's tokenizer and template."""

from fastapi import APIRouter

from gateway.deps import ChatPrincipal, ServicesDep
from gateway.errors import APIError
from gateway.schemas import DetokenizeRequest, TokenizeRequest
from gateway.services import Services
from provenance.memory import build_messages

router = APIRouter(tags=["tokenize"])


def check_model(services: Services, model: str | None) -> None:
    if model is not None and model not in services.served_model_names:
        raise APIError(404, f"the model '{model}' does not exist", param="model",
                       code="model_not_found")


@router.post("/tokenize")
def tokenize(body: TokenizeRequest, services: ServicesDep, _: ChatPrincipal) -> dict:
    check_model(services, body.model)
    tokenizer = services.tokenizer
    if body.messages is not None:
        # As a chat request renders them, without retrieved sources.
        messages = build_messages([m.model_dump(exclude_none=True) for m in body.messages], [])
        _, tokens = services.render(messages, body.add_generation_prompt)
    else:
        tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    return {
        "count": len(tokens),
        "max_model_len": services.max_model_len,
        "tokens": tokens,
        "token_strs": (
            [tokenizer.decode([t], skip_special_tokens=False) for t in tokens]
            if body.return_token_strs
            else None
        ),
    }


@router.post("/detokenize")
def detokenize(body: DetokenizeRequest, services: ServicesDep, _: ChatPrincipal) -> dict:
    check_model(services, body.model)
    vocab = services.tokenizer.vocab_size
    if not all(0 <= t < vocab for t in body.tokens):
        raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens",
                       code="invalid_value")
    return {"prompt": services.tokenizer.decode(body.tokens, skip_special_tokens=False)}
