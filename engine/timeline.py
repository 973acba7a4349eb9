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
from dataclasses import dataclass, field

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

    def summary(self, clean_step_baseline: float | None = None) -> dict:
        """Derived latencies in seconds. `clean_step_baseline` (e.g. the engine's median
        decode step without prefill) prices interference when every gap of this request had
        prefill work in it."""
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
        return {
            "num_output_tokens": len(times),
            "num_cached_tokens": self.num_cached_tokens,
            "num_preemptions": self.num_preemptions,
            "queue_time": None if first_scheduled is None else first_scheduled - arrival,
            "ttft": None if first_token is None else first_token - arrival,
            "prefill_time": (
                None if first_token is None or first_scheduled is None
                else first_token - first_scheduled
            ),
            "decode_time": decode_time,
            "tpot": decode_time / (len(times) - 1) if len(times) > 1 else None,
            "itl": itl,
            "e2e": None if self.finished is None else self.finished - arrival,
            "prefill_chunks": [
                {"step": c.step, "tokens": c.num_tokens, "start": c.start - arrival,
                 "end": c.end - arrival}
                for c in self.prefill_chunks
            ],
            "decode_steps": len(itl),
            "interference_steps": len(hit),
            # Which decode steps (indices into itl) shared their pass with prefill work.
            "interfered_steps": [i for i, flag in enumerate(self.interfered) if flag],
            "interference_time": interference_time,
            "clean_itl_median": baseline,
            "kv_transfer_time": (
                None if self.kv_transfer_end is None
                else self.kv_transfer_end - self.kv_transfer_start
            ),
            "kv_transfer": (
                None if self.kv_transfer_end is None
                else {"start": self.kv_transfer_start - arrival,
                      "end": self.kv_transfer_end - arrival, "bytes": self.kv_transfer_bytes}
            ),
        }
