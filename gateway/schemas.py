"""Typed request and response models at the edge (OpenAI-compatible, plus ``inherent`` extras)."""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class StreamOptions(BaseModel):
    include_usage: bool = False


class InherentOptions(BaseModel):
    """Inherent's own request fields: pin a snapshot, or turn retrieval off."""

    model_config = ConfigDict(extra="forbid")
    retrieval: bool = True
    snapshot: int | None = Field(
        None, ge=0, description="Epoch to retrieve at; default: the current one."
    )
    top_k: int | None = Field(None, ge=1, le=32)


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, gt=0)
    max_completion_tokens: int | None = Field(None, gt=0)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1)
    inherent: InherentOptions = Field(default_factory=InherentOptions)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4 or not all(stops):
            raise ValueError("stop must be up to 4 non-empty strings")
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
