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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

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
