"""The colocated engine: one process schedules, runs the model and postprocesses, step by step.

Requests enter through `add_request` and leave through `abort_request` (engine/intake.py: both
only queue, for the next step to drain); sampled tokens become outputs in
engine/output_processor.py. Disaggregated mode (engine/disaggregated.py) is its sibling behind
the same interface (engine/engine_protocol.py); each of its workers runs one of these.
"""

import torch
from prometheus_client import CollectorRegistry

from engine import offline
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.finish_reason import FinishReason
from engine.intake import RequestIntake
from engine.metrics import EngineMetrics
from engine.model_runner import ModelRunner
from engine.output_processor import OutputProcessor
from engine.request_output import RequestOutput
from engine.sampling import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import Sequence
from engine.timeline import now


class LLMEngine:
    def __init__(self, config: EngineConfig, model_runner: ModelRunner, tokenizer=None,
                 registry: CollectorRegistry | None = None, model_id: str = "inherent",
                 weights_hash: str | None = None):
        """`tokenizer` may be None when requests bring token ids (no text, no stop strings
        then). Metrics go to `registry` (a private one when None)."""
        num_blocks = model_runner.num_kv_blocks
        self.config = config
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.weights_hash = weights_hash  # what receipts record
        self.intake = RequestIntake(config, tokenizer, model_runner.vocab_size, num_blocks)
        self.block_manager = BlockManager(num_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager)
        self.model_runner = model_runner
        self.metrics = EngineMetrics(registry if registry is not None else CollectorRegistry(),
                                     model_id)
        self.output = OutputProcessor(config, tokenizer, self.scheduler, self.metrics,
                                      self.intake.requests)
        self.num_steps = 0
        self.num_prefill_steps = 0  # steps that ran prefill work: interference detection

    @classmethod
    def from_config(cls, config: EngineConfig, registry: CollectorRegistry | None = None
                    ) -> "LLMEngine":
        """Load the model named by the config (the bundled SmolLM2-135M by default). Either
        mode: engine.factory.create_engine."""
        from engine.loader import load_checkpoint
        from engine.model_files import bundled_model_path

        if config.mode != "colocated":
            raise ValueError(f"LLMEngine is the colocated mode, not {config.mode!r}: "
                             f"use engine.factory.create_engine")
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        checkpoint = load_checkpoint(config.model or bundled_model_path())
        return cls(config, ModelRunner.from_checkpoint(checkpoint, config), checkpoint.tokenizer,
                   registry, checkpoint.model_id, checkpoint.weights_hash)

    # -- requests in and out ----------------------------------------------------------------

    @property
    def requests(self) -> dict[str, Sequence]:
        """The unfinished requests by id."""
        return self.intake.requests

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting + self.intake.num_queued

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival: float | None = None) -> str:
        """Queue a request; raises InvalidRequest or EngineOverloaded before any work."""
        return self.intake.add(prompt, params, request_id, arrival, self.scheduler.num_waiting)

    def abort_request(self, request_id: str) -> None:
        """Thread-safe; the request's blocks are freed at the next step."""
        self.intake.abort(request_id)

    def fail_all(self) -> list[str]:
        """After a failed step: retire every request (freeing its blocks); their ids. Runs
        on the thread that calls `step()`."""
        self.intake.drain(self.scheduler)  # every request ends below, the aborted ones too
        failed = list(self.requests)
        for request_id in failed:
            self.output.finish(self.requests[request_id], FinishReason.ABORT)
        return failed

    def has_unfinished_requests(self) -> bool:
        return self.intake.has_unfinished()

    def is_healthy(self) -> bool:
        return True  # nothing outside the step loop can fail on its own

    def reset_prefix_cache(self) -> int:
        """Forget the prefix cache's free blocks (see BlockManager.reset_prefix_cache)."""
        return self.block_manager.reset_prefix_cache()

    def generate(self, prompts: list[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run the prompts to completion; one output per prompt, in order, with the whole
        text and all output token ids."""
        return offline.generate(self, prompts, params)

    # -- hand-offs: the workers of disaggregated mode -----------------------------------------

    def detach(self, request_id: str) -> Sequence:
        """Take a running request out of the engine with its blocks still allocated (the
        prefill worker holds them until its KV is sent)."""
        seq = self.requests.pop(request_id)
        self.scheduler.detach(seq)
        return seq

    def adopt(self, seq: Sequence) -> None:
        """Run a request whose KV is already in its blocks (the decode worker, once it
        received it) from its next token on."""
        seq.prefill_steps_seen = self.num_prefill_steps
        self.requests[seq.request_id] = seq
        self.scheduler.adopt(seq)

    # -- the step loop ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs = [self.output.finish(seq, FinishReason.ABORT)
                   for seq in self.intake.drain(self.scheduler)]
        batch = self.scheduler.schedule()
        if batch:
            start = now()
            tokens = self.model_runner.run(batch)
            outputs += self._postprocess(batch, tokens, start, now())
        self._observe_step(outputs)
        return outputs

    def _postprocess(self, batch: ScheduledBatch, tokens: list[int], start: float,
                     end: float) -> list[RequestOutput]:
        step = self.num_steps
        self.num_steps += 1
        if batch.num_prefill_tokens:
            self.num_prefill_steps += 1
        elif batch.num_decode_tokens:
            self.output.record_clean_decode_step(end - start)
        prefill_steps = self.num_prefill_steps
        was_decoding = [seq.is_decoding for seq in batch.seqs]
        self.scheduler.update(batch)
        outputs = []
        sampled = iter(tokens)
        for seq, n, decoding in zip(batch.seqs, batch.num_new_tokens, was_decoding, strict=True):
            if not decoding:
                seq.timeline.record_prefill_chunk(step, n, start, end)
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prefill chunk that is not the last one
            outputs.append(self.output.on_token(seq, next(sampled), end,
                                                prefill_steps > seq.prefill_steps_seen))
            seq.prefill_steps_seen = prefill_steps
        return outputs

    def _observe_step(self, outputs: list[RequestOutput]) -> None:
        bm = self.block_manager
        self.metrics.observe_step(
            self.scheduler.num_running, self.scheduler.num_waiting, bm.usage,
            sum(len(o.token_ids) for o in outputs), self.scheduler.num_preemptions,
            bm.prefix_cache_queries, bm.prefix_cache_hits,
        )
