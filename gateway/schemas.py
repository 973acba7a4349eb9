"""Typed request and response models at the edge (OpenAI-compatible, plus ``inherent`` extras)."""

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

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


class ContentPart(BaseModel):
    """One part of an array ``content``; only text parts reach this text-only model."""

    model_config = ConfigDict(extra="allow")  # a part's payload key is named by its type
    type: str
    text: Text | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")  # tool_calls, audio, ...: refused by name
    # "developer" is the newer name of "system" (rendered as system); "tool": _no_tool_turns.
    role: Literal["system", "developer", "user", "assistant"]
    # A string, or parts whose texts are joined with newlines (as vLLM does); the model and the
    # receipt see the joined string.
    content: Text | list[ContentPart] | None
    name: str | None = None  # accepted; the chat templates served here do not render it

    @field_validator("content")
    @classmethod
    def _join_text_parts(cls, value: str | list[ContentPart] | None) -> str | None:
        if not isinstance(value, list):
            return value
        for i, part in enumerate(value):
            if part.type != "text":
                raise ValueError(
                    f"content part {i} has type '{part.type}'; this model reads text only "
                    "(image, audio and file parts are not supported)"
                )
            if part.text is None:
                raise ValueError(f"content part {i} is a text part without 'text'")
        return "\n".join(part.text for part in value)

    @model_validator(mode="before")
    @classmethod
    def _no_tool_turns(cls, value: Any) -> Any:
        # Before the fields: a tool message's tool_call_id would be refused first, less clearly.
        if isinstance(value, dict) and value.get("role") == "tool":
            raise ValueError("'tool' messages are not supported: this server does not call tools")
        return value

    @model_validator(mode="after")
    def _content_present(self) -> "ChatMessage":
        if self.content is None:
            if self.role != "assistant":
                raise ValueError(f"a {self.role} message needs content")
            self.content = ""
        return self


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    # vLLM's extension: every chunk carries the usage so far (guidellm asks for it).
    continuous_usage_stats: bool = False


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # json_object / json_schema would need constrained decoding, which this server lacks.
    type: Literal["text"]


class InherentOptions(BaseModel):
    """Inherent's own request fields: pin a snapshot, or turn retrieval off."""

    model_config = ConfigDict(extra="forbid")
    retrieval: bool = True
    snapshot: int | None = Field(
        None, ge=0, le=MAX_SEED, description="Epoch to retrieve at; default: the current one."
    )
    top_k: int | None = Field(None, ge=1, le=32)


class GenerationRequest(BaseModel):
    """The fields chat and text completions share. Every field is honoured (and recorded in the
    receipt) or refused by name: an unknown field is a 400, never silently dropped."""

    model_config = ConfigDict(extra="forbid")
    model: Text = Field(max_length=256)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, gt=0, le=MAX_TOKENS)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=MAX_TOP_K)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: Text | list[Text] | None = None
    n: int = Field(1, ge=1, le=1)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)  # vLLM's extension
    min_tokens: int = Field(0, ge=0)  # vLLM's extension
    ignore_eos: bool = False  # vLLM's extension (load generators ask for exact lengths)
    logit_bias: dict[str, float] | None = None
    # Accepted and without effect on the answer: who asked, and OpenAI's storage hints.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

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

    @field_validator("logit_bias")
    @classmethod
    def _bias_by_token_id(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (value or {}).items():
            if not token.isdigit() or not -100.0 <= bias <= 100.0:
                raise ValueError("logit_bias maps token ids to biases in [-100, 100]")
        return value

    @property
    def asked_max_tokens(self) -> int | None:
        return self.max_tokens


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, gt=0, le=MAX_TOKENS)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    # No tool calling here: an empty list and tool_choice "none"/"auto" change nothing.
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto"] | None = None
    parallel_tool_calls: bool | None = None
    inherent: InherentOptions = Field(default_factory=InherentOptions)

    @field_validator("messages")
    @classmethod
    def _has_user_turn(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not any(m.role == "user" and m.content.strip() for m in value):
            raise ValueError("messages must contain a non-empty user message")
        return value

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value: list | None) -> list | None:
        if value:
            raise ValueError("tool calling is not supported by this server")
        return value

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def asked_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(GenerationRequest):
    """The legacy text completions: the prompt goes to the model as it is, no retrieval."""

    prompt: Text | list[int] | list[Text] | list[list[int]] = Field(min_length=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list) and value and isinstance(value[0], str | list):
            if len(value) != 1:
                raise ValueError("one prompt per request (n = 1); send several requests")
            value = value[0]
        if isinstance(value, list) and not value:
            raise ValueError("the prompt is empty")
        return value

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


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
    logprobs: dict[str, Any] | None = None


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
class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    input: str | list[str] = Field(min_length=1)
    # The openai client asks for base64 (little-endian float32) unless told otherwise.
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, gt=0)
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _texts(cls, value: str | list[str]) -> list[str]:
        texts = [value] if isinstance(value, str) else value
        if len(texts) > 2048 or not all(texts):
            raise ValueError("input must be 1 to 2048 non-empty strings")
        return texts


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a text prompt, or chat messages rendered by the chat template."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int] = Field(min_length=1)
