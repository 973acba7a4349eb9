"""The step loop: schedule, run, postprocess.

Requests enter through `add_request` (validated, tokenized and queued in the caller's thread) and
leave through `abort_request`; both land in inboxes that `step()` drains first, so a caller on
another thread (the asyncio front) never touches the scheduler while a step runs, and an abort
frees its blocks at the next step.
"""

import itertools
import statistics
import uuid
from collections import deque
from dataclasses import dataclass

import torch
from prometheus_client import CollectorRegistry

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.finish_reason import FinishReason
from engine.metrics import EngineMetrics
from engine.model_runner import ModelRunner
from engine.sampler import SAMPLING_FAILED
from engine.sampling import InvalidRequest, SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.timeline import TimelineSummary, now


class EngineOverloaded(RuntimeError):
    """The waiting queue is full: try again later (HTTP 429)."""


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    text: str  # new text since the previous output (the whole text from LLMEngine.generate)
    token_ids: list[int]  # new token ids since the previous output
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int  # so far
    metrics: TimelineSummary | None = None  # the request's timeline summary, on the final output
    error: str | None = None  # why a request ended by failure (finish_reason ABORT)
    # One entry per token in `token_ids` when the request asks for logprobs (Sequence.logprobs).
    logprobs: list | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig, model_runner: ModelRunner, tokenizer=None,
                 registry: CollectorRegistry | None = None, model_id: str = "inherent",
                 weights_hash: str | None = None):
        """`tokenizer` may be None when requests bring token ids (no text, no stop strings
        then). Metrics go to `registry` (a private one when None)."""
        num_blocks = model_runner.num_kv_blocks
        if num_blocks * config.block_size < config.max_model_len:
            raise ValueError(
                f"KV cache of {num_blocks} blocks x {config.block_size} tokens cannot hold one "
                f"request of max_model_len={config.max_model_len} tokens"
            )
        self.config = config
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.weights_hash = weights_hash  # what receipts record
        self.eos_token_ids = frozenset(getattr(tokenizer, "eos_token_ids", ()) or ())
        self.block_manager = BlockManager(num_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager)
        self.model_runner = model_runner
        self.metrics = EngineMetrics(registry if registry is not None else CollectorRegistry(),
                                     model_id)
        self.requests: dict[str, Sequence] = {}  # unfinished requests by id
        self.num_steps = 0
        self._inbox: deque[Sequence] = deque()
        self._aborts: deque[str] = deque()
        self._request_counter = itertools.count()
        self._clean_decode_steps: deque[float] = deque(maxlen=256)  # recent, without prefill
        self._num_prefill_steps = 0  # steps that ran prefill work: interference detection

    @classmethod
    def from_config(cls, config: EngineConfig, registry: CollectorRegistry | None = None
                    ) -> "LLMEngine":
        """Load the model named by the config (the bundled SmolLM2-135M by default). With
        `config.mode == "disaggregated"`, a DisaggregatedEngine (prefill and decode workers)."""
        from engine.loader import load_checkpoint
        from engine.model_files import bundled_model_path

        if config.mode == "disaggregated":
            from engine.disaggregated import DisaggregatedEngine

            return DisaggregatedEngine.from_config(config, registry)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        checkpoint = load_checkpoint(config.model or bundled_model_path())
        return cls(config, ModelRunner.from_checkpoint(checkpoint, config), checkpoint.tokenizer,
                   registry, checkpoint.model_id, checkpoint.weights_hash)

    # -- requests in and out ----------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival: float | None = None) -> str:
        """Queue a request; raises InvalidRequest or EngineOverloaded before any work."""
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
        vocab = self.model_runner.vocab_size
        if vocab is not None and not 0 <= min(token_ids) <= max(token_ids) < vocab:
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab})")
        if vocab is not None and params.top_k > vocab:
            raise InvalidRequest(f"top_k must be at most the vocabulary size, {vocab}")
        if len(token_ids) >= self.config.max_model_len:
            raise InvalidRequest(
                f"the prompt has {len(token_ids)} tokens; the context window is "
                f"{self.config.max_model_len} tokens, including at least one output token"
            )
        if params.stop and self.tokenizer is None:
            raise InvalidRequest("stop strings need a tokenizer")
        if vocab is not None and params.logit_bias and max(params.logit_bias) >= vocab:
            raise InvalidRequest(f"logit_bias token ids must be in [0, {vocab})")
        if len(self.scheduler.waiting) + len(self._inbox) >= self.config.max_waiting_requests:
            raise EngineOverloaded(
                f"{self.config.max_waiting_requests} requests are already waiting"
            )
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        seed = params.seed
        if seed is None:
            seed = hash((self.config.seed, next(self._request_counter))) & 0x7FFF_FFFF_FFFF_FFFF
        seq = Sequence(request_id, token_ids, params, seed)
        if arrival is not None:
            seq.timeline.arrival = arrival
        if self.tokenizer is not None:
            seq.detokenizer = self.tokenizer.detokenizer(token_ids)
        self.requests[request_id] = seq
        self._inbox.append(seq)
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Thread-safe; the request's blocks are freed at the next step."""
        self._aborts.append(request_id)

    def fail_all(self) -> list[str]:
        """After a failed step: retire every request (freeing its blocks); their ids. Runs
        on the thread that calls `step()`."""
        while self._inbox:
            self.scheduler.add(self._inbox.popleft())
        self._aborts.clear()
        failed = list(self.requests)
        for request_id in failed:
            self.scheduler.finish(self.requests[request_id], FinishReason.ABORT)
            self._finish_output(self.requests[request_id])
        return failed

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self._aborts)

    def reset_prefix_cache(self) -> int:
        """Forget the prefix cache's free blocks (see BlockManager.reset_prefix_cache)."""
        return self.block_manager.reset_prefix_cache()

    # -- the step loop ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs = self._drain_inboxes()
        batch = self.scheduler.schedule()
        if batch:
            start = now()
            tokens = self.model_runner.run(batch)
            outputs += self._postprocess(batch, tokens, start, now())
        self._observe_step(outputs)
        return outputs

    def _drain_inboxes(self) -> list[RequestOutput]:
        while self._inbox:
            self.scheduler.add(self._inbox.popleft())
        outputs = []
        while self._aborts:
            seq = self.requests.get(self._aborts.popleft())
            if seq is not None and seq.status is not SequenceStatus.FINISHED:
                self.scheduler.finish(seq, FinishReason.ABORT)
                outputs.append(self._finish_output(seq))
        return outputs

    def _postprocess(self, batch: ScheduledBatch, tokens: list[int], start: float,
                     end: float) -> list[RequestOutput]:
        step = self.num_steps
        self.num_steps += 1
        if batch.num_prefill_tokens:
            self._num_prefill_steps += 1
        elif batch.num_decode_tokens:
            self._clean_decode_steps.append(end - start)
        prefill_steps = self._num_prefill_steps
        was_decoding = [seq.is_decoding for seq in batch.seqs]
        self.scheduler.update(batch)
        outputs = []
        sampled = iter(tokens)
        for seq, n, decoding in zip(batch.seqs, batch.num_new_tokens, was_decoding, strict=True):
            if not decoding:
                seq.timeline.record_prefill_chunk(step, n, start, end)
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prefill chunk that is not the last one
            token = next(sampled)
            seq.token_ids.append(token)
            seq.timeline.record_token(end, prefill_steps > seq.prefill_steps_seen)
            seq.prefill_steps_seen = prefill_steps
            outputs.append(self._check_and_emit(seq, token))
        return outputs

    def _check_and_emit(self, seq: Sequence, token: int) -> RequestOutput:
        if token == SAMPLING_FAILED:
            seq.token_ids.pop()
            seq.error = "sampling failed"
            self.scheduler.finish(seq, FinishReason.ABORT)
            return self._finish_output(seq)
        params = seq.params
        reason = None
        is_eos = token in self.eos_token_ids
        if token in params.stop_token_ids or (is_eos and not params.ignore_eos):
            reason = FinishReason.STOP  # the stop token's text is not part of the output
        elif seq.detokenizer is not None and not is_eos:
            # EOS (kept under ignore_eos) renders as nothing; fed to the streaming decoder, a
            # run of them would grow its pending buffer, re-decoded at every token.
            new_text = seq.detokenizer.step(token)
            if new_text:
                # As vLLM: stop strings count from min_tokens on (EOS and stop ids are masked
                # by the sampler until then).
                reason = self._append_text(seq, new_text,
                                           seq.num_output_tokens >= params.min_tokens)
        if reason is None and (seq.num_output_tokens >= params.max_tokens
                               or seq.num_tokens >= self.config.max_model_len):
            reason = FinishReason.LENGTH
        if reason is not None:
            self.scheduler.finish(seq, reason)
            return self._finish_output(seq)
        # Hold back text that may turn out to start a stop string.
        hold = max((len(s) for s in params.stop), default=1) - 1
        visible = max(seq.num_sent_chars, len(seq.output_text) - hold)
        text = seq.output_text[seq.num_sent_chars : visible]
        seq.num_sent_chars = visible
        seq.num_sent_tokens = seq.num_output_tokens
        return RequestOutput(seq.request_id, text, [token], False, None,
                             seq.num_prompt_tokens, seq.num_output_tokens,
                             logprobs=seq.logprobs[-1:] if params.logprobs is not None else None)

    @staticmethod
    def _append_text(seq: Sequence, new_text: str, check_stops: bool = True
                     ) -> FinishReason | None:
        """Add detokenized text; on a stop string, trim the text at it and return STOP."""
        stops = seq.params.stop if check_stops else ()
        text = seq.output_text + new_text
        if stops:
            # Only a stop string that ends in the new text can be new.
            from_char = max(0, len(seq.output_text) - max(len(s) for s in stops) + 1)
            found = [i for s in stops if (i := text.find(s, from_char)) >= 0]
            if found:
                seq.output_text = text[: min(found)]
                return FinishReason.STOP
        seq.output_text = text
        return None

    def _finish_output(self, seq: Sequence) -> RequestOutput:
        """The final output of a request: what was not streamed yet, and its timeline."""
        timeline = seq.timeline
        timeline.finished = now()
        self.requests.pop(seq.request_id, None)
        baseline = (statistics.median(self._clean_decode_steps)
                    if self._clean_decode_steps else None)
        summary = timeline.summary(baseline, seq.finish_reason, seq.num_prompt_tokens)
        self.metrics.observe_finished(summary)
        text = seq.output_text[seq.num_sent_chars :]
        seq.num_sent_chars = len(seq.output_text)
        new_tokens = seq.output_token_ids[seq.num_sent_tokens :]
        logprobs = (seq.logprobs[seq.num_sent_tokens :]
                    if seq.params.logprobs is not None else None)
        seq.num_sent_tokens = seq.num_output_tokens
        return RequestOutput(seq.request_id, text, new_tokens, True, seq.finish_reason,
                             seq.num_prompt_tokens, seq.num_output_tokens, summary, seq.error,
                             logprobs)

    def _observe_step(self, outputs: list[RequestOutput]) -> None:
        bm = self.block_manager
        self.metrics.observe_step(
            len(self.scheduler.running), len(self.scheduler.waiting), bm.usage,
            sum(len(o.token_ids) for o in outputs), self.scheduler.num_preemptions,
            bm.prefix_cache_queries, bm.prefix_cache_hits,
        )

    # -- offline use ------------------------------------------------------------------------

    def generate(self, prompts: list[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run the prompts to completion; one output per prompt, in order, with the whole
        text and all output token ids."""
        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(prompts)
        pending = deque(zip(prompts, params, strict=True))
        seqs: list[Sequence] = []
        finals: dict[str, RequestOutput] = {}
        while pending or len(finals) < len(seqs):
            # Feed no more than the waiting queue holds.
            room = self.config.max_waiting_requests - len(self.scheduler.waiting)
            for _ in range(min(room, len(pending))):
                seqs.append(self.requests[self.add_request(*pending.popleft())])
            for out in self.step():
                if out.finished:
                    finals[out.request_id] = out
        return [
            RequestOutput(s.request_id, s.output_text, s.output_token_ids, True,
                          s.finish_reason, s.num_prompt_tokens, s.num_output_tokens,
                          finals[s.request_id].metrics, finals[s.request_id].error,
                          s.logprobs if s.params.logprobs is not None else None)
            for s in seqs
        ]
