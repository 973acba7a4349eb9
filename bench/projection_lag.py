"""How far an API replica's embedded index trails the truth layer (provenance/projection.py).

A "worker" commits epochs to SQL and to its own index (384-dimensional vectors, as MiniLM's,
in the embeddings cache as ingestion leaves them); a "replica" index, with its own directory,
catches up from SQL alone. Measured:

* the background lag: from a commit to the moment the replica's catch-up loop (interval
  ``--interval``) has applied it, over ``--epochs`` commits spaced at random;
* the cost of a catch-up, per epoch and per point, for epochs of ``--chunks`` chunks;
* what a search pays when nothing is new (the one query that proves the replica is current);
* a cold replica's rebuild of everything committed so far.

The baseline is the writer's own index write for the same epochs (the dual write the worker
already does). Last line: one JSON object.

    .venv/bin/python -m bench.projection_lag [--epochs 20] [--chunks 50] [--interval 1.0]
        [--database-url postgresql+psycopg://...]   # default: a SQLite file
"""

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from provenance import truth
from provenance.db import get_sessionmaker
from provenance.migrate import ensure_schema
from provenance.projection import CatchUpLoop, IndexProjection
from provenance.truth import ChunkDraft, SourceDraft
from provenance.vector_index import EdgeIndex

DIM = 384
MODEL = "bench-embedder"


def epoch_drafts(epoch: int, chunks: int) -> tuple[list[SourceDraft], dict[str, np.ndarray]]:
    rng = np.random.default_rng(epoch)
    drafts, vectors = [], {}
    for doc in range(max(1, chunks // 10)):
        parts = []
        for ordinal in range(10):
            text = f"epoch {epoch} doc {doc} chunk {ordinal}"
            digest = truth.content_hash(text)
            vector = rng.standard_normal(DIM).astype(np.float32)
            vectors[digest] = vector / np.linalg.norm(vector)
            parts.append(ChunkDraft(ordinal, text, digest, 6, 0, len(text)))
        body = truth.content_hash("".join(p.chunk_hash for p in parts))
        drafts.append(SourceDraft(f"doc-{doc}.md", f"file:///doc-{doc}.md", "text", body, tuple(parts)))
    return drafts, vectors


def commit(sessions, writer, drafts, vectors) -> tuple[int, float]:
    with sessions() as session, session.begin():
        truth.store_vectors(session, MODEL, vectors)
    start = time.perf_counter()
    epoch = truth.commit(sessions, writer, "acme", upserts=drafts, vectors=vectors).epoch
    return epoch, time.perf_counter() - start


def run(args) -> dict:
    root = Path(tempfile.mkdtemp(prefix="inherent-projection-"))
    url = args.database_url or f"sqlite:///{root / 'inherent.db'}"
    ensure_schema(url)
    sessions = get_sessionmaker(url)
    writer = EdgeIndex(root / "worker", DIM)
    replica = IndexProjection(sessions, EdgeIndex(root / "api", DIM), MODEL, root / "api.json")

    # Catch-up cost, epoch by epoch, against the writer's own commit (the baseline).
    costs, commits = [], []
    for epoch in range(1, args.epochs + 1):
        drafts, vectors = epoch_drafts(epoch, args.chunks)
        _, spent = commit(sessions, writer, drafts, vectors)
        commits.append(spent)
        done = replica.catch_up("acme")
        costs.append(done.seconds)
    points = sum(len(d.chunks) for d in epoch_drafts(1, args.chunks)[0])

    # Nothing new: what every search pays to know the replica is current.
    start = time.perf_counter()
    for _ in range(200):
        assert replica.catch_up("acme") is None
    current_check = (time.perf_counter() - start) / 200

    # Background lag: commits at random moments, the loop applies them.
    loop = CatchUpLoop(replica, args.interval)
    loop.start()
    lags = []
    for epoch in range(args.epochs + 1, 2 * args.epochs + 1):
        time.sleep(random.uniform(0, args.interval))
        drafts, vectors = epoch_drafts(epoch, args.chunks)
        committed, _ = commit(sessions, writer, drafts, vectors)
        at = time.perf_counter()
        while replica.applied("acme") < committed:
            time.sleep(0.005)
        lags.append(time.perf_counter() - at)
    loop.stop()

    # A cold replica (a new pod) rebuilds everything from SQL.
    cold = IndexProjection(sessions, EdgeIndex(root / "cold", DIM), MODEL)
    rebuilt = cold.catch_up("acme")
    return {
        "bench": "projection_lag",
        "database": url.split(":", 1)[0],
        "epochs": args.epochs,
        "points_per_epoch": points,
        "interval_s": args.interval,
        "lag_s_median": statistics.median(lags),
        "lag_s_max": max(lags),
        "catch_up_ms_per_epoch_median": 1000 * statistics.median(costs),
        "writer_commit_ms_per_epoch_median": 1000 * statistics.median(commits),
        "catch_up_us_per_point": 1e6 * statistics.median(costs) / points,
        "current_check_ms": 1000 * current_check,
        "cold_rebuild_points": rebuilt.points_written,
        "cold_rebuild_s": rebuilt.seconds,
        "catch_up_vs_writer": statistics.median(costs) / statistics.median(commits),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--chunks", type=int, default=50)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--database-url", default="")
    result = run(parser.parse_args())
    for key, value in result.items():
        print(f"{key:36} {value:.3f}" if isinstance(value, float) else f"{key:36} {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
