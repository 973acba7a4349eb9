"""Engine settings: one typed object, validated once when it is built, read everywhere else.

Every engine default lives here. The server reads the same fields from its ``INHERENT_*``
environment (gateway/settings.py nests this object in its settings tree), so a new knob is one
field here.
"""

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, PositiveFloat, PositiveInt
from pydantic.dataclasses import dataclass


def cpu_list(cpus: str | tuple[int, ...] | list[int] | None) -> tuple[int, ...] | None:
    """Cores written as the kernel writes them (`taskset -c`, /sys/.../cpulist): "2", "0-3",
    "0,2,4-5"; None for an empty string. A sequence of core numbers passes as a tuple."""
    if not isinstance(cpus, str):
        return None if cpus is None else tuple(cpus)
    if not cpus.strip():
        return None
    parsed: list[int] = []
    for part in cpus.split(","):
        first, _, last = part.strip().partition("-")
        last = last or first
        if not (first.isdigit() and last.isdigit() and int(first) <= int(last)):
            raise ValueError(f"not a CPU list (e.g. '0-3,6'): {cpus!r}")
        parsed += range(int(first), int(last) + 1)
    return tuple(parsed)


# Cores of one disaggregated worker: "0-3,6" or (0, 1, 2, 3, 6), at least one; None or "": unset.
Cpus = Annotated[
    Annotated[tuple[int, ...], Field(min_length=1)] | None, BeforeValidator(cpu_list)
]


@dataclass(config={"extra": "forbid"})
class EngineConfig:
    # Which model, how to run it.
    model: str | None = None  # GGUF file or model folder; None = the bundled SmolLM2-135M
    # Weights and activations; "bfloat16" favours large batches/prefill.
    dtype: Literal["float32", "bfloat16"] = "float32"
    kv_cache_dtype: str | None = None  # None = the matmuls' dtype (engine.model)
    device: str = "cpu"
    num_threads: PositiveInt | None = None  # torch intra-op threads; None = torch's default
    # The nice value (Linux) of AsyncEngine's step thread, which the OpenMP workers it starts
    # inherit: on few cores the API's threads (retrieval, receipts, the event loop) get a core
    # back sooner while the engine computes. 16 streams through the API (bench.serving, Zen 4
    # kind, four 60 s runs each): provenance overhead p50 10.3-11.7 ms against 12.4-14.7 at 0,
    # output 168-172 tok/s either way.
    step_thread_nice: int = Field(5, ge=0, le=19)

    # Paged KV cache.
    block_size: PositiveInt = 16  # tokens per KV block
    num_kv_blocks: PositiveInt | None = None  # explicit block count; overrides kv_cache_bytes
    kv_cache_bytes: PositiveInt = 2 << 30  # budget for the KV cache when num_kv_blocks is None
    enable_prefix_caching: bool = True

    # Scheduling (vLLM V1 style: one token budget per step, decodes first).
    max_num_seqs: PositiveInt = 64  # running sequences at most
    # Token budget of one step; measured, bench/interference.py.
    max_num_batched_tokens: PositiveInt = 192
    enable_chunked_prefill: bool = True  # off: whole prompts, in prefill-only steps (V0 policy)
    # Per-request prefill cap per step; None = the step's budget.
    long_prefill_token_threshold: PositiveInt | None = None
    max_model_len: PositiveInt = 4096  # prompt + output tokens of one request
    # Beyond it add_request raises EngineOverloaded (the API answers 429).
    max_waiting_requests: PositiveInt = 256

    # Bit-identical logits for a request whatever its companions, chunk boundaries or prefix-cache
    # hits (fixed-order attention kernel, matmuls never on a shape-dependent path), so replay
    # can claim bit-identical answers; see engine/batch_invariant.py. "auto": on wherever the
    # mode runs (CPU, float32, the C++ kernels built), off elsewhere; its cost on the CPU kinds
    # measured is under 5 % (bench/batch_invariance.py, README).
    batch_invariant: bool | Literal["auto"] = "auto"

    seed: int = 0  # seeds requests that bring no seed of their own

    # "colocated": one process runs prefill and decode. "disaggregated": a prefill worker and a
    # decode worker process, the prompt's KV blocks handed over torch.distributed (gloo on CPU,
    # NCCL between GPUs); see engine/disaggregated.py.
    mode: Literal["colocated", "disaggregated"] = "colocated"
    disagg_addr: str = "127.0.0.1"  # rendezvous host of the KV-transfer process group
    # Its port; 0 = a free port, a fresh one at every (re)start.
    disagg_port: int = Field(0, ge=0, lt=65536)
    disagg_prefill_cpus: Cpus = None  # None = first half of our cores
    disagg_decode_cpus: Cpus = None  # None = the other half
    disagg_prefill_device: str | None = None  # None = `device` (CUDA: GPU 0)
    disagg_decode_device: str | None = None  # None = `device` (CUDA: the next GPU)
    disagg_prefill_kv_blocks: PositiveInt | None = None  # None = sized as the colocated cache
    disagg_decode_kv_blocks: PositiveInt | None = None
    # Seconds for the workers to load and join the group.
    disagg_start_timeout: PositiveFloat = 300.0
    # Failed (re)starts in a row before the engine gives up.
    disagg_max_restarts: int = Field(3, ge=0)
    # A serving worker whose step loop shows no progress for this long is hung (SIGSTOP, a stuck
    # forward or KV transfer): it is killed and both workers restarted, as after a death. Its
    # loop marks progress at every step, every decoder layer of a forward and every second
    # while idle, so this must exceed one decoder layer's forward over a whole step (a chunk
    # of max_num_batched_tokens; a whole prompt with chunked prefill off) on a loaded core,
    # and one KV transfer.
    disagg_heartbeat_timeout: PositiveFloat = 10.0
    # "forkserver" forks workers from a process that imported torch once: a restart takes ~1 s
    # instead of the ~4-8 s of "spawn" (a fresh interpreter importing torch) on 2 cores.
    disagg_start_method: Literal["spawn", "forkserver"] = "spawn"

    def __post_init__(self) -> None:
        # Rules between fields (pydantic has checked each field by now).
        float32_on_cpu = self.dtype == "float32" and self.device.startswith("cpu")
        if self.batch_invariant == "auto":
            from engine import cpu_kernels  # builds the kernels once, or remembers why it cannot

            self.batch_invariant = float32_on_cpu and cpu_kernels.available()
        if self.batch_invariant and not float32_on_cpu:
            raise ValueError("batch_invariant needs dtype float32 on the CPU")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Decodes go first in running order: a budget below the seat count would starve
            # the same requests at every step.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs})"
            )

    @property
    def prefill_chunk_cap(self) -> int:
        """Most prompt tokens one request may compute in one step."""
        if not self.enable_chunked_prefill:
            return self.max_model_len
        return self.long_prefill_token_threshold or self.max_num_batched_tokens
