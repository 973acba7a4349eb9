"""Per-request sampling settings, validated before any work is done."""

from dataclasses import dataclass, field


class InvalidRequest(ValueError):
    """A request rejected before any work: bad sampling settings or a prompt that cannot fit."""


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy (argmax of fp32 logits)
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None  # None = derived from the engine seed and the request's arrival order
    stop: list[str] = field(default_factory=list)  # text-level; trimmed from the output
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Prefix-cache namespace (vLLM's cache_salt): cached KV is shared only between requests with
    # the same salt. The gateway salts by tenant. It never changes what is computed.
    cache_salt: str = ""
    # Before any other processing, in vLLM's order: repetition over prompt and output tokens
    # (positive logits divided, negative multiplied), then frequency (x count) and presence
    # (once) over output tokens. Greedy rows see them too: they change the argmax.
    repetition_penalty: float = 1.0  # 1 = off
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_tokens: int = 0  # EOS and stop token ids are masked, stop strings unchecked, until then
    logit_bias: dict[int, float] = field(default_factory=dict)  # added to the raw logits
    # None = no logprobs; k = the sampled token's log-probability and the k most likely ones,
    # from the model's raw distribution (log-softmax of the fp32 logits, before any processing).
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # JSON object keys are strings: a receipt's logit_bias comes back as {"42": 1.5}.
        if isinstance(self.logit_bias, dict):
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError) as exc:
                raise InvalidRequest(
                    f"logit_bias must map token ids to numbers, got {self.logit_bias!r}"
                ) from exc
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    def processes_logits(self, output_index: int) -> bool:
        """Whether the logits of the token at `output_index` change before sampling."""
        return self.penalized or bool(self.logit_bias) or output_index < self.min_tokens

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool):
            raise InvalidRequest(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens <= 0:
            raise InvalidRequest(f"max_tokens must be > 0, got {self.max_tokens}")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequest(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise InvalidRequest(f"seed must be a non-negative integer, got {self.seed!r}")
        if not isinstance(self.stop, list | tuple) or not all(
            isinstance(s, str) and s for s in self.stop
        ):
            raise InvalidRequest(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list | tuple) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise InvalidRequest(
                f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}"
            )
        if not self.repetition_penalty > 0.0 or self.repetition_penalty == float("inf"):
            raise InvalidRequest(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequest(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequest(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens!r}"
            )
        if not isinstance(self.logit_bias, dict) or not all(
            t >= 0 and -100.0 <= b <= 100.0 for t, b in self.logit_bias.items()
        ):
            raise InvalidRequest(
                "logit_bias must map non-negative token ids to biases in [-100, 100]"
            )
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20
        ):
            raise InvalidRequest(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
