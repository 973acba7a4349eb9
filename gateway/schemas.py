"""Typed request and response models at the edge (OpenAI-compatible, plus ``inherent`` extras)."""

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

# Bounds on what one request may ask, checked before any work (SECURITY.md). Sizes are also
# bounded by the body limit (Settings.max_json_body_bytes) and the model's context window.
MAX_MESSAGES = 256
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
MAX_TOKENS = 1 << 20
MAX_TOP_K = 1 << 20  # and at most the vocabulary, checked against the model
MAX_SEED = (1 << 63) - 1


def encodable(text: str) -> str:
    """JSON can spell lone surrogates ("\\ud800"); they cannot be encoded, stored or tokenized."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"invalid Unicode: a lone surrogate at character {exc.start}") from exc
    return text


Text = Annotated[str, AfterValidator(encodable)]


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: Text


class StreamOptions(BaseModel):
    include_usage: bool = False


class InherentOptions(BaseModel):
    """Inherent's own request fields: pin a snapshot, or turn retrieval off."""

    model_config = ConfigDict(extra="forbid")
    retrieval: bool = True
    snapshot: int | None = Field(
        None, ge=0, le=MAX_SEED, description="Epoch to retrieve at; default: the current one."
    )
    top_k: int | None = Field(None, ge=1, le=32)


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Text = Field(max_length=256)
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, gt=0, le=MAX_TOKENS)
    max_completion_tokens: int | None = Field(None, gt=0, le=MAX_TOKENS)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=MAX_TOP_K)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: Text | list[Text] | None = None
    n: int = Field(1, ge=1, le=1)
    inherent: InherentOptions = Field(default_factory=InherentOptions)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_STRINGS or not all(0 < len(s) <= MAX_STOP_CHARS for s in stops):
            raise ValueError(
                f"stop must be up to {MAX_STOP_STRINGS} non-empty strings of at most "
                f"{MAX_STOP_CHARS} characters"
            )
        return stops

    @field_validator("messages")
    @classmethod
    def _has_user_turn(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not any(m.role == "user" and m.content.strip() for m in value):
            raise ValueError("messages must contain a non-empty user message")
        return value


class Citation(BaseModel):
    index: int
    source_id: str
    version: int
    chunk_id: str
    chunk_hash: str
    span: tuple[int, int]
    title: str
    score: float


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessage
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    citations: list[Citation]
    receipt_id: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "inherent"
    weights_hash: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ReceiptOut(BaseModel):
    id: str
    status: str
    created_at: str
    body: dict[str, Any]
    inclusion_proof: dict[str, Any] | None
    body_canonical: str  # canonical JSON of body: the bytes the leaf's body_hash commits to
    # The audit leaf's data recomputed from the row now (hashed as 0x00 || data); None: not logged.
    leaf_data: str | None
    diagnosis: dict[str, Any] | None  # which phase owned this request's latency


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """Every failure's body, OpenAI's shape (gateway/errors.py)."""

    error: ErrorDetail


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": description}
    for status, description in {
        400: "Bad input: the error names the parameter",
        401: "Missing or unknown API key",
        403: "The key lacks the scope, or the path is not allowed",
        404: "Not found, or not the caller's tenant's",
        405: "Method not allowed",
        413: "The body is over its limit",
        429: "A quota or the engine's queue is full; see Retry-After",
        500: "An internal failure; details are in the server log under the reference",
        503: "Not ready",
    }.items()
}
