"""Offline use of either engine mode: run prompts to completion, one whole output each."""

from collections import deque

from engine.engine_protocol import Engine
from engine.request_output import RequestOutput
from engine.sampling import SamplingParams


def generate(engine: Engine, prompts: list[str | list[int]],
             params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
    """One output per prompt, in order, with the whole text and all output token ids."""
    if not isinstance(params, list):
        params = [params or SamplingParams()] * len(prompts)
    pending = deque(zip(prompts, params, strict=True))
    streamed: dict[str, list[RequestOutput]] = {}  # by request id, in order of the prompts
    num_finished = 0
    while pending or num_finished < len(streamed):
        # Feed no more than the waiting queue holds.
        room = engine.config.max_waiting_requests - engine.num_waiting
        for _ in range(min(room, len(pending))):
            streamed[engine.add_request(*pending.popleft())] = []
        for out in engine.step():
            if out.request_id in streamed:
                streamed[out.request_id].append(out)
                num_finished += out.finished
    return [_whole(parts) for parts in streamed.values()]


def _whole(parts: list[RequestOutput]) -> RequestOutput:
    """A request's streamed outputs joined: the text and token ids are the sums of the parts'."""
    last = parts[-1]
    logprobs = None if last.logprobs is None else [e for p in parts for e in p.logprobs]
    return RequestOutput(last.request_id, "".join(p.text for p in parts),
                         [t for p in parts for t in p.token_ids], True, last.finish_reason,
                         last.num_prompt_tokens, last.num_output_tokens, last.metrics,
                         last.error, logprobs)
