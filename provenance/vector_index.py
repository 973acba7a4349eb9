"""The vector index: one small interface, two backends.

``EdgeIndex`` runs Qdrant's Rust engine in process (qdrant-edge-py) and is the embedded
default; ``QdrantClientIndex`` speaks to a Qdrant server through qdrant-client (or to the
client's local mode in tests). Both store one point per chunk, keyed by the chunk's
deterministic UUID, with the payload ``{tenant, source_id, version, chunk_id, chunk_hash,
valid_from, valid_to, live}``.

A point is visible at snapshot E iff ``valid_from <= E < valid_to`` — the same test SQL uses.
Range filters are slow when they match most of a large index, so ``live`` (the tenant while the
version is open, "" once closed) gives a keyword fast path: when no point of the tenant was
closed after E, the visible set is exactly the live points with ``valid_from <= E``. The index
only mirrors SQL; callers still check hits against SQL visibility (``provenance.memory``), which
covers points written ahead of a commit that never happened and closes whose payload update was
cut short. ``provenance.sweep.sweep`` repairs both.

Search is exact and returns hits in a total order: score descending, then chunk hash, then
chunk id.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from threading import Lock
from typing import Any, NamedTuple, Protocol

import numpy as np

from provenance.models import OPEN_EPOCH
from provenance.settings import Settings

SCAN_PAGE = 1024
# Range conditions travel as float64, where OPEN_EPOCH (2^63 - 1) rounds up to 2^63; real epochs
# stay far below 2^53, so "closed" is ``valid_to < CLOSED_BELOW``, a bound floats hold exactly.
CLOSED_BELOW = 2**53
# What a search reads of each hit's payload: what the order and the snapshot check need. The chunk
# id is also the point's id, but reading that builds a uuid.UUID per hit; every field fetched
# costs the search too (warm, 13 hits of 372 points: 0.32 ms a search with seven fields and the
# id, 0.17 ms as now).
SEARCH_PAYLOAD = ["chunk_id", "chunk_hash", "valid_from", "valid_to"]


@dataclass(frozen=True, slots=True)
class IndexPoint:
    """One chunk's point. ``vector`` is None when the point comes back from ``scan``."""

    chunk_id: str
    tenant_id: str
    source_id: str
    version: int
    chunk_hash: str
    valid_from: int
    valid_to: int = OPEN_EPOCH
    vector: np.ndarray | None = None

    def payload(self) -> dict[str, Any]:
        return {
            "tenant": self.tenant_id,
            "source_id": self.source_id,
            "version": self.version,
            "chunk_id": self.chunk_id,
            "chunk_hash": self.chunk_hash,
            "valid_from": self.valid_from,
            "valid_to": self.valid_to,
            "live": self.tenant_id if self.valid_to == OPEN_EPOCH else "",
        }

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> IndexPoint:
        return cls(
            chunk_id=payload["chunk_id"],
            tenant_id=payload["tenant"],
            source_id=payload["source_id"],
            version=int(payload["version"]),
            chunk_hash=payload["chunk_hash"],
            valid_from=int(payload["valid_from"]),
            valid_to=int(payload["valid_to"]),
        )

    def same_payload(self, other: IndexPoint) -> bool:
        return self.payload() == other.payload()


class IndexHit(NamedTuple):
    chunk_id: str
    score: float
    chunk_hash: str
    valid_from: int
    valid_to: int

    @property
    def order_key(self) -> tuple[float, str, str]:
        return (-self.score, self.chunk_hash, self.chunk_id)


class VectorIndex(Protocol):
    dim: int

    def upsert(self, points: Sequence[IndexPoint]) -> None:
        """Write points (vector and payload); the same chunk id overwrites, so re-runs converge."""
        ...

    def close_version(self, tenant_id: str, source_id: str, version: int, valid_to: int) -> None:
        """Set ``valid_to`` (and clear ``live``) on every point of one source version."""
        ...

    def set_payloads(self, points: Sequence[IndexPoint]) -> None:
        """Overwrite the payload of existing points with the given ones (the sweep's repair)."""
        ...

    def delete(self, chunk_ids: Sequence[str]) -> None: ...

    def search(
        self, tenant_id: str, vector: np.ndarray, snapshot_epoch: int, limit: int
    ) -> list[IndexHit]:
        """Exact top-``limit`` among the tenant's points visible at ``snapshot_epoch``."""
        ...

    def scan(self, tenant_id: str | None = None) -> Iterator[IndexPoint]:
        """Every point (payload only), for the sweep."""
        ...

    def count(self, tenant_id: str | None = None) -> int: ...

    def flush(self) -> None:
        """Make every write so far durable."""
        ...

    def optimize(self) -> None:
        """Compact segments after a bulk of writes (a no-op where the server does it)."""
        ...

    def close(self) -> None: ...


def _hit(score: float, payload: dict[str, Any]) -> IndexHit:
    """A hit from its score and its SEARCH_PAYLOAD."""
    return IndexHit(
        payload["chunk_id"],
        # Qdrant scores are float32; qdrant-client's local mode computes in float64 and its last
        # bits vary between calls, so every backend's score is cut to float32.
        float(np.float32(score)),
        payload["chunk_hash"],
        int(payload["valid_from"]),
        int(payload["valid_to"]),
    )


def exact_top(
    query: Callable[[int], list[IndexHit]], limit: int, keep: Callable[[IndexHit], bool]
) -> list[IndexHit]:
    """Top ``limit`` hits that pass ``keep``, in the total order, ties at the cut included.

    ``query(n)`` returns the backend's best ``n`` by score. Fetch more while the page is full
    and either too few hits pass ``keep`` or the last fetched score still ties the cut, so the
    chunk-hash tie-break sees every candidate and the answer does not depend on how the backend
    orders equal scores.
    """
    if limit <= 0:
        return []
    # One more than asked: a lower score after the cut proves no tie hides beyond the page.
    fetch = limit + 1
    while True:
        raw = query(fetch)
        kept = sorted((h for h in raw if keep(h)), key=lambda h: h.order_key)
        exhausted = len(raw) < fetch
        if exhausted:
            return kept[:limit]
        if len(kept) >= limit and min(h.score for h in raw) < kept[limit - 1].score:
            return kept[:limit]
        fetch *= 2


class _QdrantIndex:
    """What both backends share: the search strategy, the filters and a scan's paging. A backend
    supplies the three primitive queries and the types its filters are built of: ``_api``, its
    API's module (both APIs name ``Filter``, ``FieldCondition`` and ``MatchValue`` alike), and
    ``_range_type``, the one type they name apart."""

    _api: Any
    _range_type: Any

    def _match(self, key: str, value: Any) -> Any:
        return self._api.FieldCondition(key=key, match=self._api.MatchValue(value=value))

    def _range(self, key: str, **bounds: int) -> Any:
        """``key`` within ``bounds`` (``lt``, ``lte``, ``gt``)."""
        return self._api.FieldCondition(key=key, range=self._range_type(**bounds))

    def _filter(self, *conditions: Any) -> Any:
        """Every one of ``conditions``."""
        return self._api.Filter(must=list(conditions))

    def _tenant_filter(self, tenant_id: str | None) -> Any:
        """The tenant's points; None, every point, when no tenant is named."""
        return self._filter(self._match("tenant", tenant_id)) if tenant_id else None

    def _version_filter(self, tenant_id: str, source_id: str, version: int) -> Any:
        return self._filter(
            self._match("tenant", tenant_id),
            self._match("source_id", source_id),
            self._match("version", version),
        )

    def _visible_filter(self, tenant_id: str, snapshot_epoch: int | None) -> Any:
        """The points ``_query`` ranks: the tenant's live ones when ``snapshot_epoch`` is None,
        else those whose ``[valid_from, valid_to)`` holds it."""
        if snapshot_epoch is None:
            return self._filter(self._match("live", tenant_id))
        return self._filter(
            self._match("tenant", tenant_id),
            self._range("valid_from", lte=snapshot_epoch),
            self._range("valid_to", gt=snapshot_epoch),
        )

    def _query(
        self, vector: np.ndarray, tenant_id: str, snapshot_epoch: int | None, limit: int
    ) -> list[IndexHit]:
        """Best ``limit`` by score: live points when ``snapshot_epoch`` is None, else the range."""
        raise NotImplementedError

    def _latest_close(self, tenant_id: str) -> int:
        """The largest ``valid_to`` among the tenant's closed points (0 when none)."""
        raise NotImplementedError

    def _page(self, flt: Any, offset: Any) -> tuple[list[Any], Any]:
        """Up to ``SCAN_PAGE`` records matching ``flt`` from ``offset``, with their payloads, and
        the next page's offset (None after the last page)."""
        raise NotImplementedError

    def scan(self, tenant_id: str | None = None) -> Iterator[IndexPoint]:
        flt, offset = self._tenant_filter(tenant_id), None
        while True:
            records, offset = self._page(flt, offset)
            for record in records:
                yield IndexPoint.from_payload(record.payload)
            if offset is None:
                return

    def search(
        self, tenant_id: str, vector: np.ndarray, snapshot_epoch: int, limit: int
    ) -> list[IndexHit]:
        vector = np.asarray(vector, dtype=np.float32)
        epoch = snapshot_epoch
        if self._latest_close(tenant_id) <= epoch:
            hits = exact_top(
                lambda n: self._query(vector, tenant_id, None, n),
                limit,
                keep=lambda h: h.valid_from <= epoch,
            )
            # A close applied while we searched could have hidden points visible at the
            # snapshot; seeing none after the search proves the live set was the right one.
            if self._latest_close(tenant_id) <= epoch:
                return hits
        return exact_top(
            lambda n: self._query(vector, tenant_id, epoch, n),
            limit,
            keep=lambda h: h.valid_from <= epoch < h.valid_to,
        )


def _point_uuid(chunk_id: str) -> str:
    return str(uuid.UUID(chunk_id))


# ---------------------------------------------------------------------------------------------
# Qdrant Edge: the embedded default
# ---------------------------------------------------------------------------------------------


class EdgeIndex(_QdrantIndex):
    """Qdrant's engine in process, stored under one directory.

    Vectors are stored as float16 by default: exact search reads every candidate vector, so
    halving the bytes per vector nearly halves latency on a memory-bound scan (cosine scores
    move by ~1e-4, ranking is still exact over what is stored; SQL keeps the float32
    originals). Segments carry no HNSW graph (m=0): every search is a full, exact scan, and
    ``optimize`` only turns appendable segments into compact immutable ones.

    Searches run on a pool of ``search_threads`` threads. Qdrant's default, sized from the CPU
    count (eight threads on 2 vCPUs), handed every search of the one segment ``optimize``
    leaves to another thread and kept its idle threads yielding the CPU in a loop: a search
    after a 320 MB cache sweep took 0.52 ms with it and 0.34 with one thread, 0.11 against
    0.075 ms warm (Zen 4 kind, 372 points).

    One process may open a directory at a time; ``open_vector_index`` shares the handle inside
    a process.
    """

    def __init__(
        self, path: Path | str, dim: int, datatype: str = "float16", search_threads: int = 1
    ) -> None:
        import qdrant_edge as qe

        self._api, self._range_type = qe, qe.RangeFloat
        self.dim = dim
        self.path = Path(path)
        stored = self.path / "edge_config.json"
        if stored.exists():
            # An existing shard keeps the layout it was created with; only the size must match.
            vectors = json.loads(stored.read_text())["vectors"][""]
            if vectors["size"] != dim:
                raise ValueError(
                    f"the vector index at {self.path} holds {vectors['size']}-dimensional "
                    f"vectors, but the embedder gives {dim}: use another collection name "
                    "(INHERENT_COLLECTION)"
                )
            datatype = vectors.get("datatype") or "float32"
        storage = {"float16": qe.VectorStorageDatatype.Float16, "float32": None}[datatype]
        vector_params = qe.EdgeVectorParams(
            size=dim, distance=qe.Distance.Cosine, datatype=storage
        )
        # Every write through this handle (the process's only one, and no other process opens
        # the shard) moves the generation, odd while it applies: a tenant's latest close is
        # scrolled for once per generation, not twice per search (0.7 ms of every query).
        self._generation = 0
        self._write_lock = Lock()
        self._latest_closes: dict[str, tuple[int, int]] = {}  # tenant: (generation, close)
        if stored.exists():
            # What a load leaves unnamed keeps its stored value.
            self._shard = qe.EdgeShard.load(
                str(self.path),
                qe.EdgeConfig(vectors=vector_params, max_search_threads=search_threads),
            )
        else:
            self.path.mkdir(parents=True, exist_ok=True)
            config = qe.EdgeConfig(
                vectors=vector_params,
                hnsw_config=qe.HnswIndexConfig(m=0, ef_construct=100, full_scan_threshold=10_000),
                optimizers=qe.EdgeOptimizersConfig(indexing_threshold=1_000),
                payload_memory=qe.Memory.Cached,
                max_search_threads=search_threads,
            )
            self._shard = qe.EdgeShard.create(str(self.path), config)
            for field_name, schema in self._payload_indexes().items():
                self._update(qe.UpdateOperation.create_field_index(field_name, schema))

    def _payload_indexes(self) -> dict[str, Any]:
        qe = self._api
        return {
            "tenant": qe.KeywordIndexParams(is_tenant=True),
            "live": qe.KeywordIndexParams(is_tenant=True),
            "source_id": qe.PayloadSchemaType.Keyword,
            "version": qe.IntegerIndexParams(lookup=True, range=False),
            "valid_from": qe.IntegerIndexParams(lookup=False, range=True),
            "valid_to": qe.IntegerIndexParams(lookup=True, range=True),
        }

    def upsert(self, points: Sequence[IndexPoint]) -> None:
        qe = self._api
        for start in range(0, len(points), SCAN_PAGE):
            batch = [
                qe.Point(_point_uuid(p.chunk_id), _as_list(p.vector, self.dim), p.payload())
                for p in points[start : start + SCAN_PAGE]
            ]
            self._update(qe.UpdateOperation.upsert_points(batch))

    def close_version(self, tenant_id: str, source_id: str, version: int, valid_to: int) -> None:
        self._update(
            self._api.UpdateOperation.set_payload_by_filter(
                self._version_filter(tenant_id, source_id, version),
                {"valid_to": valid_to, "live": tenant_id if valid_to == OPEN_EPOCH else ""},
            )
        )

    def set_payloads(self, points: Sequence[IndexPoint]) -> None:
        for p in points:
            self._update(
                self._api.UpdateOperation.overwrite_payload([_point_uuid(p.chunk_id)], p.payload())
            )

    def delete(self, chunk_ids: Sequence[str]) -> None:
        if chunk_ids:
            ids = [_point_uuid(c) for c in chunk_ids]
            self._update(self._api.UpdateOperation.delete_points(ids))

    def _update(self, operation: Any) -> None:
        with self._write_lock:
            self._generation += 1
            try:
                self._shard.update(operation)
            finally:
                self._generation += 1

    def _query(
        self, vector: np.ndarray, tenant_id: str, snapshot_epoch: int | None, limit: int
    ) -> list[IndexHit]:
        qe = self._api
        found = self._shard.search(
            qe.SearchRequest(
                query=qe.Query.Nearest(vector.tolist()),
                limit=limit,
                filter=self._visible_filter(tenant_id, snapshot_epoch),
                params=qe.SearchParams(exact=True),
                with_payload=SEARCH_PAYLOAD,
            )
        )
        return [_hit(p.score, p.payload) for p in found]

    def _latest_close(self, tenant_id: str) -> int:
        """As scrolled at this generation. A search that reads it before and after its query
        and finds the generation unmoved saw no write beside it, as a second scroll would."""
        generation = self._generation
        known = self._latest_closes.get(tenant_id)
        if known is not None and known[0] == generation:
            return known[1]
        close = self._scroll_latest_close(tenant_id)
        if generation % 2 == 0 and self._generation == generation:
            self._latest_closes[tenant_id] = (generation, close)
        return close

    def _scroll_latest_close(self, tenant_id: str) -> int:
        qe = self._api
        records, _ = self._shard.scroll(
            qe.ScrollRequest(
                limit=1,
                filter=self._filter(self._match("tenant", tenant_id), self._match("live", "")),
                with_payload=["valid_to"],
                order_by=qe.OrderBy(
                    key="valid_to", direction=qe.Direction.Desc, start_from=CLOSED_BELOW
                ),
            )
        )
        return int(records[0].payload["valid_to"]) if records else 0

    def _page(self, flt: Any, offset: Any) -> tuple[list[Any], Any]:
        return self._shard.scroll(
            self._api.ScrollRequest(offset=offset, limit=SCAN_PAGE, filter=flt, with_payload=True)
        )

    def count(self, tenant_id: str | None = None) -> int:
        return self._shard.count(
            self._api.CountRequest(exact=True, filter=self._tenant_filter(tenant_id))
        )

    def flush(self) -> None:
        self._shard.flush()

    def optimize(self) -> None:
        self._shard.optimize()

    def close(self) -> None:
        self._shard.close()


# ---------------------------------------------------------------------------------------------
# qdrant-client: a Qdrant server in production, the client's local mode in tests
# ---------------------------------------------------------------------------------------------


class QdrantClientIndex(_QdrantIndex):
    """A collection on a Qdrant server (or in qdrant-client's local mode, which speaks the same
    API: ``QdrantClient(location=":memory:")`` or ``QdrantClient(path=...)``)."""

    def __init__(self, client: Any, collection: str, dim: int) -> None:
        from qdrant_client import models as qm

        self._api, self._range_type = qm, qm.Range
        self.client = client
        self.collection = collection
        self.dim = dim
        if not client.collection_exists(collection):
            client.create_collection(
                collection,
                vectors_config=qm.VectorParams(size=dim, distance=qm.Distance.COSINE),
            )
            if not self._is_local:
                for field_name, schema in self._payload_indexes().items():
                    client.create_payload_index(collection, field_name, schema, wait=True)
        size = self._vector_size()
        if size != dim:
            raise ValueError(
                f"Qdrant collection {collection!r} holds {size}-dimensional vectors, "
                f"but the embedder gives {dim}: use another collection name (INHERENT_COLLECTION)"
            )

    @property
    def _is_local(self) -> bool:
        # Local mode keeps no payload indexes (it warns on every create); the server does.
        return type(self.client._client).__name__ == "QdrantLocal"

    def _vector_size(self) -> int:
        vectors = self.client.get_collection(self.collection).config.params.vectors
        return vectors.size if hasattr(vectors, "size") else next(iter(vectors.values())).size

    def _payload_indexes(self) -> dict[str, Any]:
        qm = self._api
        return {
            "tenant": qm.KeywordIndexParams(type=qm.KeywordIndexType.KEYWORD, is_tenant=True),
            "live": qm.KeywordIndexParams(type=qm.KeywordIndexType.KEYWORD, is_tenant=True),
            "source_id": qm.PayloadSchemaType.KEYWORD,
            "version": qm.IntegerIndexParams(
                type=qm.IntegerIndexType.INTEGER, lookup=True, range=False
            ),
            "valid_from": qm.IntegerIndexParams(
                type=qm.IntegerIndexType.INTEGER, lookup=False, range=True
            ),
            "valid_to": qm.IntegerIndexParams(
                type=qm.IntegerIndexType.INTEGER, lookup=True, range=True
            ),
        }

    def upsert(self, points: Sequence[IndexPoint]) -> None:
        qm = self._api
        for start in range(0, len(points), SCAN_PAGE):
            batch = [
                qm.PointStruct(
                    id=_point_uuid(p.chunk_id),
                    vector=_as_list(p.vector, self.dim),
                    payload=p.payload(),
                )
                for p in points[start : start + SCAN_PAGE]
            ]
            self.client.upsert(self.collection, points=batch, wait=True)

    def close_version(self, tenant_id: str, source_id: str, version: int, valid_to: int) -> None:
        self.client.set_payload(
            self.collection,
            payload={"valid_to": valid_to, "live": tenant_id if valid_to == OPEN_EPOCH else ""},
            points=self._version_filter(tenant_id, source_id, version),
            wait=True,
        )

    def set_payloads(self, points: Sequence[IndexPoint]) -> None:
        for p in points:
            self.client.overwrite_payload(
                self.collection, payload=p.payload(), points=[_point_uuid(p.chunk_id)], wait=True
            )

    def delete(self, chunk_ids: Sequence[str]) -> None:
        if chunk_ids:
            self.client.delete(
                self.collection,
                points_selector=self._api.PointIdsList(points=[_point_uuid(c) for c in chunk_ids]),
                wait=True,
            )

    def _query(
        self, vector: np.ndarray, tenant_id: str, snapshot_epoch: int | None, limit: int
    ) -> list[IndexHit]:
        response = self.client.query_points(
            self.collection,
            query=vector.tolist(),
            query_filter=self._visible_filter(tenant_id, snapshot_epoch),
            limit=limit,
            # Local mode is always brute force and warns about search params.
            search_params=None if self._is_local else self._api.SearchParams(exact=True),
            with_payload=SEARCH_PAYLOAD,
        )
        return [_hit(p.score, p.payload) for p in response.points]

    def _latest_close(self, tenant_id: str) -> int:
        qm = self._api
        records, _ = self.client.scroll(
            self.collection,
            scroll_filter=self._filter(
                self._match("tenant", tenant_id),
                self._match("live", ""),
                self._range("valid_to", lt=CLOSED_BELOW),
            ),
            limit=1,
            order_by=qm.OrderBy(
                key="valid_to", direction=qm.Direction.DESC, start_from=CLOSED_BELOW
            ),
            with_payload=["valid_to"],
        )
        return int(records[0].payload["valid_to"]) if records else 0

    def _page(self, flt: Any, offset: Any) -> tuple[list[Any], Any]:
        return self.client.scroll(
            self.collection, scroll_filter=flt, limit=SCAN_PAGE, offset=offset, with_payload=True
        )

    def count(self, tenant_id: str | None = None) -> int:
        return self.client.count(
            self.collection, count_filter=self._tenant_filter(tenant_id), exact=True
        ).count

    def flush(self) -> None:
        # Writes use wait=True: the server has applied them when the call returns.
        return None

    def optimize(self) -> None:
        return None

    def close(self) -> None:
        self.client.close()


def _as_list(vector: np.ndarray | None, dim: int) -> list[float]:
    if vector is None:
        raise ValueError("a point needs its vector to be written")
    values = np.asarray(vector, dtype=np.float32).reshape(-1)
    if values.shape[0] != dim:
        raise ValueError(f"vector has {values.shape[0]} dimensions, the index holds {dim}")
    return values.tolist()


_open_indexes: dict[tuple[str, str, int], VectorIndex] = {}
_open_lock = Lock()


def open_vector_index(settings: Settings, dim: int) -> VectorIndex:
    """The configured index, opened once per process: a Qdrant server when ``qdrant_url`` is
    set, else the embedded Edge shard under ``embedded_index_dir/<collection>``.

    The embedded shard must not be opened by two processes at once: with Celery workers, point
    ``qdrant_url`` at a server.
    """
    if settings.qdrant_url:
        key = ("server", f"{settings.qdrant_url}#{settings.collection}", dim)
    else:
        key = ("edge", str((settings.embedded_index_dir / settings.collection).resolve()), dim)
    with _open_lock:
        index = _open_indexes.get(key)
        if index is None:
            if settings.qdrant_url:
                from qdrant_client import QdrantClient

                client = QdrantClient(url=settings.qdrant_url, api_key=settings.qdrant_api_key)
                index = QdrantClientIndex(client, settings.collection, dim)
            else:
                index = EdgeIndex(
                    settings.embedded_index_dir / settings.collection,
                    dim,
                    search_threads=settings.index_search_threads,
                )
            _open_indexes[key] = index
        return index


def close_vector_indexes() -> None:
    """Close every index ``open_vector_index`` opened in this process (tests, shutdown)."""
    with _open_lock:
        for index in _open_indexes.values():
            index.close()
        _open_indexes.clear()
