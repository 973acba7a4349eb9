"""One request's state. The scheduler only looks at two numbers: tokens known and tokens whose
KV is computed; each step closes part of the gap (a prefill chunk, or one decode token)."""

from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

from engine.finish_reason import FinishReason
from engine.sampling import SamplingParams
from engine.timeline import RequestTimeline


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt, then every generated token
    params: SamplingParams
    seed: int  # the sampling seed actually used (the request's, or one the engine derived)
    num_prompt_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chain hashes of full blocks
    num_registered_blocks: int = 0  # leading blocks already in the prefix cache
    finish_reason: FinishReason | None = None
    timeline: RequestTimeline = field(default_factory=RequestTimeline)
    detokenizer: Any = None  # incremental detokenizer state, owned by the engine
    output_text: str = ""  # detokenized output, stop strings trimmed
    num_sent_chars: int = 0  # how much of output_text was already streamed
    num_sent_tokens: int = 0  # how many output tokens were already streamed
    prefill_steps_seen: int = 0  # the engine's count of steps with prefill work, at last token
    error: str | None = None  # set when this request alone failed (its sampling raised)
    # Per output token, when the request asks for logprobs: (the token, its log-probability,
    # [(token id, log-probability)] of the most likely ones), appended by the model runner.
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_decoding(self) -> bool:
        """Only the last sampled token is left to compute: a decode step."""
        computed = self.num_computed_tokens
        return computed == len(self.token_ids) - 1 and computed >= self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
