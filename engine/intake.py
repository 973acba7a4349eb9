"""Requests in, for both engine modes: validated, tokenized and queued in the caller's thread.

`add` and `abort` only queue, so a caller on another thread (the asyncio front) never touches the
scheduler while a step runs; the step loop drains both queues first, and an abort frees its
blocks at the next step.
"""

import itertools
import uuid
from collections import deque

from engine.config import EngineConfig
from engine.sampling import InvalidRequest, SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence


class EngineOverloaded(RuntimeError):
    """The waiting queue is full: try again later (HTTP 429)."""


class RequestIntake:
    def __init__(self, config: EngineConfig, tokenizer, vocab_size: int | None,
                 num_kv_blocks: int):
        """`tokenizer` may be None when requests bring token ids (no text, no stop strings
        then); `vocab_size` (when known) bounds the token ids; every request it accepts must
        fit a KV cache of `num_kv_blocks` blocks."""
        if num_kv_blocks * config.block_size < config.max_model_len:
            raise ValueError(
                f"KV cache of {num_kv_blocks} blocks x {config.block_size} tokens cannot hold "
                f"one request of max_model_len={config.max_model_len} tokens"
            )
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.requests: dict[str, Sequence] = {}  # unfinished requests by id
        self._new: deque[Sequence] = deque()
        self._aborts: deque[str] = deque()
        self._request_counter = itertools.count()

    @property
    def num_queued(self) -> int:
        """Requests added since the last drain."""
        return len(self._new)

    def has_unfinished(self) -> bool:
        return bool(self.requests or self._aborts)

    def add(self, prompt: str | list[int], params: SamplingParams | None, request_id: str | None,
            arrival: float | None, num_waiting: int) -> str:
        """Queue a request; raises InvalidRequest or EngineOverloaded (when `num_waiting`
        requests wait in the scheduler and the queue is full) before any work."""
        config = self.config
        params = params or SamplingParams()
        params.validate()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest("this engine has no tokenizer: send token ids")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
        if not token_ids:
            raise InvalidRequest("the prompt is empty")
        vocab = self.vocab_size
        if vocab is not None and not 0 <= min(token_ids) <= max(token_ids) < vocab:
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab})")
        if vocab is not None and params.top_k > vocab:
            raise InvalidRequest(f"top_k must be at most the vocabulary size, {vocab}")
        if vocab is not None and any(token >= vocab for token in params.logit_bias):
            raise InvalidRequest(f"logit_bias token ids must be in [0, {vocab})")
        if len(token_ids) >= config.max_model_len:
            raise InvalidRequest(
                f"the prompt has {len(token_ids)} tokens; the context window is "
                f"{config.max_model_len} tokens, including at least one output token"
            )
        if params.stop and self.tokenizer is None:
            raise InvalidRequest("stop strings need a tokenizer")
        if vocab is not None and params.logit_bias and max(params.logit_bias) >= vocab:
            raise InvalidRequest(f"logit_bias token ids must be in [0, {vocab})")
        if num_waiting + len(self._new) >= config.max_waiting_requests:
            raise EngineOverloaded(f"{config.max_waiting_requests} requests are already waiting")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        seed = params.seed
        if seed is None:
            seed = hash((config.seed, next(self._request_counter))) & 0x7FFF_FFFF_FFFF_FFFF
        seq = Sequence(request_id, token_ids, params, seed)
        if arrival is not None:
            seq.timeline.arrival = arrival
        if self.tokenizer is not None:
            seq.detokenizer = self.tokenizer.detokenizer(token_ids)
        self.requests[request_id] = seq
        self._new.append(seq)
        return request_id

    def abort(self, request_id: str) -> None:
        """Thread-safe; the request is retired at the next drain."""
        self._aborts.append(request_id)

    def admit_new(self, scheduler: Scheduler) -> None:
        """On the step's thread: the requests added since join the scheduler's queue."""
        while self._new:
            scheduler.add(self._new.popleft())

    def drain(self, scheduler: Scheduler) -> list[Sequence]:
        """On the step's thread: `admit_new`, then the unfinished requests aborted since the
        last drain, for the caller to retire."""
        self.admit_new(scheduler)
        aborted: dict[str, Sequence] = {}  # an id aborted twice is retired once
        while self._aborts:
            request_id = self._aborts.popleft()
            seq = self.requests.get(request_id)
            if seq is not None and not seq.is_finished:
                aborted[request_id] = seq
        return list(aborted.values())
