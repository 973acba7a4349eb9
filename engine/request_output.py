"""What the engine hands back for a request at each step (both modes)."""

from dataclasses import dataclass

from engine.finish_reason import FinishReason
from engine.timeline import TimelineSummary


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    text: str  # new text since the previous output (the whole text from `generate`)
    token_ids: list[int]  # new token ids since the previous output
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int  # so far
    metrics: TimelineSummary | None = None  # the request's timeline summary, on the final output
    error: str | None = None  # why a request ended by failure (finish_reason ABORT)
    # One entry per token in `token_ids` when the request asks for logprobs (Sequence.logprobs).
    logprobs: list | None = None
