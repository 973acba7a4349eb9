"""Requests out, for both engine modes: a sampled token id becomes a RequestOutput.

Text, stop strings and finish reasons are decided here, and the final output carries the
request's timeline summary, which the Prometheus metrics observe.
"""

import statistics
from collections import deque

from engine.config import EngineConfig
from engine.finish_reason import FinishReason
from engine.metrics import EngineMetrics
from engine.request_output import RequestOutput
from engine.sampler import SAMPLING_FAILED
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.timeline import now


class OutputProcessor:
    def __init__(self, config: EngineConfig, tokenizer, scheduler: Scheduler,
                 metrics: EngineMetrics, requests: dict[str, Sequence]):
        """`requests`: the unfinished requests by id (RequestIntake's), which a finished
        request leaves."""
        self.max_model_len = config.max_model_len
        self.eos_token_ids = frozenset(getattr(tokenizer, "eos_token_ids", ()) or ())
        self.scheduler = scheduler
        self.metrics = metrics
        self.requests = requests
        self._clean_decode_steps: deque[float] = deque(maxlen=256)

    def record_clean_decode_step(self, seconds: float) -> None:
        """A decode step without prefill work: recent ones price the interference of a
        request whose every gap had prefill in it."""
        self._clean_decode_steps.append(seconds)

    def on_token(self, seq: Sequence, token: int, at: float, interfered: bool) -> RequestOutput:
        """A request sampled `token` at time `at` (`interfered`: prefill work ran since its
        previous token): stream it, or finish the request."""
        seq.token_ids.append(token)
        seq.timeline.record_token(at, interfered)
        if token == SAMPLING_FAILED:
            seq.token_ids.pop()
            seq.error = "sampling failed"
            return self.finish(seq, FinishReason.ABORT)
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
                reason = _append_text(seq, new_text, seq.num_output_tokens >= params.min_tokens)
        if reason is None and (seq.num_output_tokens >= params.max_tokens
                               or seq.num_tokens >= self.max_model_len):
            reason = FinishReason.LENGTH
        if reason is not None:
            return self.finish(seq, reason)
        # Hold back text that may turn out to start a stop string.
        hold = max((len(s) for s in params.stop), default=1) - 1
        visible = max(seq.num_sent_chars, len(seq.output_text) - hold)
        text = seq.output_text[seq.num_sent_chars : visible]
        seq.num_sent_chars = visible
        seq.num_sent_tokens = seq.num_output_tokens
        return RequestOutput(seq.request_id, text, [token], False, None,
                             seq.num_prompt_tokens, seq.num_output_tokens,
                             logprobs=seq.logprobs[-1:] if params.logprobs is not None else None)

    def finish(self, seq: Sequence, reason: FinishReason) -> RequestOutput:
        """Retire the request (its blocks are freed) and return its final output: what was
        not streamed yet, and its timeline summary."""
        self.scheduler.finish(seq, reason)
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


def _append_text(seq: Sequence, new_text: str, check_stops: bool) -> FinishReason | None:
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
