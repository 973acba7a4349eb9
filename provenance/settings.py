"""The settings every process shares: storage, ingestion, retrieval, the API's limits.
Environment variables use the prefix ``INHERENT_``.

The embedded default needs nothing but a data directory: SQLite, the embedded vector index,
jobs in-process and the bundled model. Production points the same names at PostgreSQL,
Qdrant, Redis and the operator's own weights. The API process's tree adds the engine's
settings (``gateway.settings.ServerSettings``); an ingestion worker needs only these.
"""

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal, TypeVar

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


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
    # Threads of the embedded index's search pool (one reads each segment). One, the default,
    # searches on the caller's core; more only pay for an index of many segments on cores the
    # engine leaves free (provenance/vector_index.py, EdgeIndex).
    index_search_threads: int = Field(1, gt=0)
    # `inherent serve` flags as vllm serve / llama-server name them (each also a setting).
    served_model_name: str = ""  # the model's name in the API; empty: the model's own
    # A bootstrap key for single-tenant use: accepted with every scope for `api_key_tenant`,
    # given as the secret itself or as a file holding it (Docker/Kubernetes secrets).
    api_key: str = Field("", repr=False)
    api_key_file: str = ""
    api_key_tenant: str = "default"
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    log_json: bool = False  # one JSON object per log line
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
    # CLI (an operator on the machine) may ingest any path. In the environment: folders
    # separated by ':' as in PATH, or a JSON list.
    ingest_allowed_roots: Annotated[list[Path], NoDecode] = Field(default_factory=list)
    # /metrics answers this bearer token, or any API key with the `audit` scope.
    metrics_token: str = ""
    # Serve /docs, /redoc and /openapi.json.
    api_docs: bool = True

    @field_validator("ingest_allowed_roots", mode="before")
    @classmethod
    def _path_list(cls, value):
        if isinstance(value, str):
            value = value.strip()
            if value.startswith("["):
                return json.loads(value)
            return [part for part in value.split(os.pathsep) if part]
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


AnySettings = TypeVar("AnySettings", bound=Settings)


@lru_cache
def get_settings(kind: type[AnySettings] = Settings) -> AnySettings:
    """This process's settings from its environment, built and validated once: ``Settings``
    for a worker, ``gateway.settings.ServerSettings`` for the API."""
    return kind()
