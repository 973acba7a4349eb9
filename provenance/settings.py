"""The one typed settings object. Environment variables use the prefix ``INHERENT_``.

The embedded default needs nothing but a data directory: SQLite, the embedded vector index,
jobs in-process and the bundled model. Production points the same names at PostgreSQL,
Qdrant, Redis and the operator's own weights.
"""

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def cpu_list(text: str) -> tuple[int, ...] | None:
    """Cores written as the kernel writes them (`taskset -c`, /sys/.../cpulist): "2", "0-3",
    "0,2,4-5"; None for an empty string."""
    if not text.strip():
        return None
    cpus: list[int] = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        last = last or first
        if not (first.isdigit() and last.isdigit() and int(first) <= int(last)):
            raise ValueError(f"not a CPU list (e.g. '0-3,6'): {text!r}")
        cpus += range(int(first), int(last) + 1)
    return tuple(cpus)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="INHERENT_", env_file=".env", extra="ignore")

    data_dir: Path = Path(".inherent")
    # SQLAlchemy URL; empty means the embedded SQLite file inside data_dir.
    database_url: str = ""
    # Qdrant server URL; empty means the embedded index inside data_dir.
    qdrant_url: str = ""
    qdrant_api_key: str | None = None
    collection: str = "inherent_chunks"
    # Celery broker; empty means ingestion jobs run in-process.
    redis_url: str = ""
    # Seconds after which the broker hands a job whose worker died (unacknowledged) to another
    # worker; longer than the longest job, or a slow job runs twice (safely, it is idempotent).
    celery_visibility_timeout: float = Field(3600.0, gt=0)

    # Model: a GGUF file or a Hugging Face checkpoint directory; empty means the bundled SmolLM2.
    model_path: str = ""
    model_dtype: Literal["float32", "bfloat16"] = "float32"
    device: str = "cpu"
    engine_mode: Literal["colocated", "disaggregated"] = "colocated"
    # Disaggregated mode (engine/disaggregated.py; the EngineConfig fields of the same names).
    # Rendezvous of the workers' KV-transfer group; port 0 = a free port at every (re)start.
    disagg_addr: str = "127.0.0.1"
    disagg_port: int = Field(0, ge=0, lt=65536)
    # Each worker's cores (CPU), as "0-3,6"; empty = the first half of ours for prefill, the
    # rest for decode.
    disagg_prefill_cpus: str = ""
    disagg_decode_cpus: str = ""
    # Each worker's device ("cuda:1"); empty = `device` (CUDA: GPU 0 prefill, GPU 1 decode).
    disagg_prefill_device: str = ""
    disagg_decode_device: str = ""
    # KV blocks of each worker's cache; unset = sized as the colocated cache.
    disagg_prefill_kv_blocks: int | None = Field(None, gt=0)
    disagg_decode_kv_blocks: int | None = Field(None, gt=0)
    disagg_start_timeout: float = Field(300.0, gt=0)  # seconds to load and join the group
    disagg_max_restarts: int = Field(3, ge=0)  # failed (re)starts in a row before giving up
    # Seconds without progress after which a serving worker counts as hung and is restarted.
    disagg_heartbeat_timeout: float = Field(10.0, gt=0)
    disagg_start_method: Literal["spawn", "forkserver"] = "spawn"
    max_num_seqs: int = Field(64, gt=0)
    max_num_batched_tokens: int = Field(192, gt=0)
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    # Same request, same bits, whatever shares its batch (engine/batch_invariant.py); replay then
    # claims bit-identical answers instead of token agreement.
    batch_invariant: bool = False
    max_waiting_requests: int = Field(256, gt=0)
    # KV cache size in tokens (all layers); 32768 tokens of SmolLM2-135M in float32 = 1.5 GB.
    kv_cache_tokens: int = Field(32768, gt=0)

    # Embedding model: a sentence-transformers directory; empty means the bundled MiniLM.
    embedding_model_path: str = ""
    chunk_tokens: int = Field(256, gt=16)
    chunk_overlap: int = Field(32, ge=0)
    max_file_bytes: int = Field(20 * 1024 * 1024, gt=0)
    # Compressed files and archives (ingest/loaders/archive.py): what one input file may expand
    # to in all, how many times its stored size, and how many members it may hold.
    archive_max_expanded_bytes: int = Field(256 * 1024 * 1024, gt=0)
    archive_max_ratio: float = Field(200.0, gt=1)
    archive_max_members: int = Field(10_000, gt=0)
    # In-process ingestion jobs (no Redis) run on a pool of this many threads; more wait queued.
    ingest_workers: int = Field(2, gt=0)
    # How long a request keeps retrying its receipt while the database is unreachable before it
    # fails closed (503, or an error event that names no receipt): no answer without its receipt.
    receipt_commit_timeout_s: float = Field(10.0, gt=0)

    retrieval_top_k: int = Field(4, gt=0)
    retrieval_min_score: float = Field(0.3, ge=-1.0, le=1.0)
    context_token_budget: int = Field(1024, gt=0)

    host: str = "127.0.0.1"
    port: int = 8000
    # Migrate the schema when an API or worker process starts (under a database lock); unset
    # means only the embedded SQLite file. Production migrates once (`inherent db upgrade`).
    migrate_on_start: bool | None = None
    # Seconds a SIGTERM'd API process lets requests in flight (streams) finish before it exits.
    shutdown_grace_s: float = Field(30.0, ge=0)
    # Seconds between catch-ups of a process's embedded vector index with the truth layer.
    index_sync_interval_s: float = Field(1.0, gt=0)
    # `inherent serve` flags as vllm serve / llama-server name them (each also a setting).
    served_model_name: str = ""  # the model's name in the API; empty: the model's own
    # A bootstrap key for single-tenant use: accepted with every scope for `api_key_tenant`,
    # given as the secret itself or as a file holding it (Docker/Kubernetes secrets).
    api_key: str = Field("", repr=False)
    api_key_file: str = ""
    api_key_tenant: str = "default"
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    log_json: bool = False  # one JSON object per log line
    threads: int = Field(0, ge=0)  # torch intra-op threads; 0 = torch's default
    # OpenTelemetry traces go to this OTLP/HTTP endpoint (http://collector:4318); empty = off.
    otel_endpoint: str = ""

    # Limits on what one request may ask (SECURITY.md). Bodies over a limit get 413 before
    # they are read; an unknown key gets 401 before any body is read.
    max_json_body_bytes: int = Field(1024 * 1024, gt=0)
    max_upload_body_bytes: int = Field(64 * 1024 * 1024, gt=0)  # one multipart ingest request
    max_upload_files: int = Field(100, gt=0)
    # Per-tenant quotas (0 = off), in this process or, with redis_url, shared by all replicas.
    tenant_max_concurrent_requests: int = Field(32, ge=0)
    tenant_requests_per_minute: int = Field(600, ge=0)
    # Server folders a tenant admin may ingest by path over HTTP; empty = uploads only. The
    # CLI (an operator on the machine) may ingest any path.
    ingest_allowed_roots: list[Path] = Field(default_factory=list)
    # /metrics answers this bearer token, or any API key with the `audit` scope.
    metrics_token: str = ""
    # Serve /docs, /redoc and /openapi.json.
    api_docs: bool = True

    @field_validator("disagg_prefill_cpus", "disagg_decode_cpus")
    @classmethod
    def _check_cpu_list(cls, value: str) -> str:
        cpu_list(value)
        return value

    @property
    def sqlalchemy_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'inherent.db').resolve()}"

    @property
    def bootstrap_api_key(self) -> str:
        if self.api_key_file:
            return Path(self.api_key_file).read_text().strip()
        return self.api_key

    @property
    def embedded_index_dir(self) -> Path:
        return self.data_dir / "vectors"


@lru_cache
def get_settings() -> Settings:
    return Settings()
