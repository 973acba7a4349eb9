"""Engine settings: one typed object, validated once, read everywhere else."""

from dataclasses import dataclass


@dataclass(slots=True)
class EngineConfig:
    # Which model, how to run it.
    model: str | None = None  # GGUF file or model folder; None = the bundled SmolLM2-135M
    dtype: str = "float32"  # weights and activations; "bfloat16" favours large batches/prefill
    kv_cache_dtype: str | None = None  # None = the matmuls' dtype (engine.model)
    device: str = "cpu"
    num_threads: int | None = None  # torch intra-op threads; None = leave torch's default

    # Paged KV cache.
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # explicit block count; overrides kv_cache_bytes
    kv_cache_bytes: int = 2 << 30  # budget for the KV cache when num_kv_blocks is None
    enable_prefix_caching: bool = True

    # Scheduling (vLLM V1 style: one token budget per step, decodes first).
    max_num_seqs: int = 64  # running sequences at most
    max_num_batched_tokens: int = 192  # token budget of one step; measured, bench/interference.py
    enable_chunked_prefill: bool = True  # off: whole prompts, in prefill-only steps (V0 policy)
    long_prefill_token_threshold: int | None = None  # per-request prefill cap per step; None = budget
    max_model_len: int = 4096  # prompt + output tokens of one request
    max_waiting_requests: int = 1024  # beyond it add_request raises EngineOverloaded

    # Bit-identical logits for a request whatever its companions, chunk boundaries or prefix-cache
    # hits (fixed-order attention kernel, matmuls never on a shape-dependent path); costs
    # some throughput, see engine/batch_invariant.py and bench/batch_invariance.py.
    batch_invariant: bool = False

    seed: int = 0  # seeds requests that bring no seed of their own

    # "colocated": one process runs prefill and decode. "disaggregated": a prefill worker and a
    # decode worker process, the prompt's KV blocks handed over torch.distributed (gloo on CPU,
    # NCCL between GPUs); see engine/disaggregated.py.
    mode: str = "colocated"
    disagg_addr: str = "127.0.0.1"  # rendezvous host of the KV-transfer process group
    disagg_port: int = 0  # its port; 0 = a free port, a fresh one at every (re)start
    disagg_prefill_cpus: tuple[int, ...] | None = None  # None = first half of our cores
    disagg_decode_cpus: tuple[int, ...] | None = None  # None = the other half
    disagg_prefill_device: str | None = None  # None = `device` (CUDA: GPU 0)
    disagg_decode_device: str | None = None  # None = `device` (CUDA: the next GPU)
    disagg_prefill_kv_blocks: int | None = None  # None = sized as the colocated cache
    disagg_decode_kv_blocks: int | None = None
    disagg_start_timeout: float = 300.0  # seconds for the workers to load and join the group
    disagg_max_restarts: int = 3  # failed (re)starts in a row before the engine gives up
    # A serving worker whose step loop shows no progress for this long is hung (SIGSTOP, a stuck
    # forward or KV transfer): it is killed and both workers restarted, as after a death. Its
    # loop marks progress at every step, every decoder layer of a forward and every second
    # while idle, so this must exceed one decoder layer's forward over a whole step (a chunk
    # of max_num_batched_tokens; a whole prompt with chunked prefill off) on a loaded core,
    # and one KV transfer.
    disagg_heartbeat_timeout: float = 10.0
    # "forkserver" forks workers from a process that imported torch once: a restart takes ~1 s
    # instead of the ~4-8 s of "spawn" (a fresh interpreter importing torch) on 2 cores.
    disagg_start_method: str = "spawn"

    def __post_init__(self) -> None:
        if self.mode not in ("colocated", "disaggregated"):
            raise ValueError(f"EngineConfig.mode must be 'colocated' or 'disaggregated', "
                             f"got {self.mode!r}")
        for name in ("disagg_prefill_cpus", "disagg_decode_cpus"):
            cpus = getattr(self, name)
            if cpus is not None:
                setattr(self, name, tuple(cpus))
                if not cpus:
                    raise ValueError(f"EngineConfig.{name} must name at least one core")
        if not 0 <= self.disagg_port < 65536:
            raise ValueError(f"EngineConfig.disagg_port must be in [0, 65536), got "
                             f"{self.disagg_port}")
        if self.disagg_start_method not in ("spawn", "forkserver"):
            raise ValueError(f"EngineConfig.disagg_start_method must be 'spawn' or "
                             f"'forkserver', got {self.disagg_start_method!r}")
        if self.batch_invariant and (self.dtype != "float32" or not self.device.startswith("cpu")):
            raise ValueError("EngineConfig.batch_invariant needs dtype float32 on the CPU")
        if self.disagg_max_restarts < 0:
            raise ValueError("EngineConfig.disagg_max_restarts must be >= 0")
        positive = {
            "block_size": self.block_size,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_model_len": self.max_model_len,
            "max_waiting_requests": self.max_waiting_requests,
            "kv_cache_bytes": self.kv_cache_bytes,
        }
        if self.num_kv_blocks is not None:
            positive["num_kv_blocks"] = self.num_kv_blocks
        if self.long_prefill_token_threshold is not None:
            positive["long_prefill_token_threshold"] = self.long_prefill_token_threshold
        if self.num_threads is not None:
            positive["num_threads"] = self.num_threads
        positive["disagg_start_timeout"] = self.disagg_start_timeout
        positive["disagg_heartbeat_timeout"] = self.disagg_heartbeat_timeout
        for name in ("disagg_prefill_kv_blocks", "disagg_decode_kv_blocks"):
            if getattr(self, name) is not None:
                positive[name] = getattr(self, name)
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"EngineConfig.{name} must be > 0, got {value}")
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
