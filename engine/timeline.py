"""What happened to one request, and when, on a monotonic clock (time.perf_counter).

The engine records raw events; `summary()` derives the numbers operators ask about: TTFT, TPOT,
inter-token latencies, queue / prefill / decode time, and prefill-decode interference: the
decode steps of this request during which prefill work ran (it shared the forward pass with
another request's prefill chunk, or, without chunked prefill, it sat out a prefill-only step),
and the time those inter-token gaps took beyond the request's median clean gap.
"""

import itertools
import statistics
import time
from dataclasses import asdict, dataclass, field, fields

from engine.finish_reason import FinishReason

now = time.perf_counter


@dataclass(slots=True)
class PrefillChunk:
    step: int
    num_tokens: int
    start: float
    end: float


@dataclass(slots=True)
class RequestTimeline:
    arrival: float = field(default_factory=now)
    first_scheduled: float | None = None
    prefill_chunks: list[PrefillChunk] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # one per output token
    interfered: list[bool] = field(default_factory=list)  # per token after the first
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    finished: float | None = None
    # Disaggregated mode: the hand-off of the prompt's KV blocks to the decode worker.
    kv_transfer_start: float | None = None
    kv_transfer_end: float | None = None
    kv_transfer_bytes: int = 0

    def record_prefill_chunk(self, step: int, num_tokens: int, start: float, end: float) -> None:
        if self.first_scheduled is None:
            self.first_scheduled = start
        self.prefill_chunks.append(PrefillChunk(step, num_tokens, start, end))

    def record_kv_transfer(self, start: float, end: float, num_bytes: int) -> None:
        self.kv_transfer_start, self.kv_transfer_end = start, end
        self.kv_transfer_bytes = num_bytes

    def record_token(self, at: float, interfered: bool) -> None:
        """An output token at time `at`; `interfered`: prefill work ran since the previous one."""
        if self.token_times:
            self.interfered.append(interfered)
        self.token_times.append(at)

    def summary(self, clean_step_baseline: float | None = None,
                finish_reason: FinishReason | None = None,
                num_prompt_tokens: int | None = None) -> "TimelineSummary":
        """Derived latencies in seconds. `clean_step_baseline` (e.g. the engine's median
        decode step without prefill) prices interference when every gap of this request had
        prefill work in it. The engine adds how the request ended and its prompt length."""
        arrival = self.arrival
        first_scheduled = self.first_scheduled
        times = self.token_times
        first_token = times[0] if times else None
        last_token = times[-1] if times else None
        itl = [b - a for a, b in itertools.pairwise(times)]
        clean = [gap for gap, hit in zip(itl, self.interfered, strict=True) if not hit]
        hit = [gap for gap, hit in zip(itl, self.interfered, strict=True) if hit]
        baseline = statistics.median(clean) if clean else clean_step_baseline
        interference_time = (
            sum(max(0.0, gap - baseline) for gap in hit) if baseline is not None else None
        )
        decode_time = last_token - first_token if times else None
        transferred = self.kv_transfer_end is not None
        return TimelineSummary(
            num_output_tokens=len(times),
            num_cached_tokens=self.num_cached_tokens,
            num_preemptions=self.num_preemptions,
            queue_time=None if first_scheduled is None else first_scheduled - arrival,
            ttft=None if first_token is None else first_token - arrival,
            prefill_time=(
                None if first_token is None or first_scheduled is None
                else first_token - first_scheduled
            ),
            decode_time=decode_time,
            tpot=decode_time / (len(times) - 1) if len(times) > 1 else None,
            itl=tuple(itl),
            e2e=None if self.finished is None else self.finished - arrival,
            prefill_chunks=tuple(
                ChunkTimes(c.step, c.num_tokens, c.start - arrival, c.end - arrival)
                for c in self.prefill_chunks
            ),
            decode_steps=len(itl),
            interference_steps=len(hit),
            interfered_steps=tuple(i for i, flag in enumerate(self.interfered) if flag),
            interference_time=interference_time,
            clean_itl_median=baseline,
            kv_transfer_time=(
                self.kv_transfer_end - self.kv_transfer_start if transferred else None
            ),
            kv_transfer=(
                TransferTimes(self.kv_transfer_start - arrival, self.kv_transfer_end - arrival,
                              self.kv_transfer_bytes) if transferred else None
            ),
            finish_reason=finish_reason,
            num_prompt_tokens=num_prompt_tokens,
        )


@dataclass(frozen=True, slots=True)
class ChunkTimes:
    """One prefill chunk of the summary: its step, tokens, and times from arrival."""

    step: int
    tokens: int
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class TransferTimes:
    """The KV hand-off of the summary (disaggregated mode): times from arrival, and bytes."""

    start: float
    end: float
    bytes: int


@dataclass(frozen=True, slots=True)
class TimelineSummary:
    """What a finished request's timeline says, read by the metrics, diagnosis, receipts and
    benches. `to_dict()` is its JSON form (receipts store it; diagnosis reads that form)."""

    num_output_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    queue_time: float | None  # arrival to first scheduled
    ttft: float | None
    prefill_time: float | None  # first scheduled to first token
    decode_time: float | None  # first token to last token
    tpot: float | None
    itl: tuple[float, ...]
    e2e: float | None
    prefill_chunks: tuple[ChunkTimes, ...]
    decode_steps: int
    interference_steps: int
    # Which decode steps (indices into itl) shared their pass with prefill work.
    interfered_steps: tuple[int, ...]
    interference_time: float | None
    clean_itl_median: float | None
    kv_transfer_time: float | None
    kv_transfer: TransferTimes | None
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int | None = None

    def to_dict(self) -> dict:
        """The JSON form: plain lists, dicts and strings, key for key in field order."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["itl"] = list(self.itl)
        out["prefill_chunks"] = [asdict(c) for c in self.prefill_chunks]
        out["interfered_steps"] = list(self.interfered_steps)
        out["kv_transfer"] = None if self.kv_transfer is None else asdict(self.kv_transfer)
        out["finish_reason"] = None if self.finish_reason is None else self.finish_reason.value
        return out
