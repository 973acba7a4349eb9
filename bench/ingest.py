"""Ingestion and retrieval-search benchmark of the embedded default (SQLite, Qdrant Edge, MiniLM).

Part 1, ingestion, through the same job function the API and the workers run
(``ingest.jobs.submit_ingestion(..., wait=True)``), on a generated corpus (fixed seed) of
Markdown files written to a temporary folder:
  1. first ingest of every document (the baseline),
  2. re-ingest with nothing changed,
  3. re-ingest with 5% of the documents edited (one sentence each).
The speedups are baseline time / re-ingest time, measured in the same run. The model is loaded
before any timing.

Part 2, search: 100k random unit vectors written straight into a fresh Edge index with the
payload ingestion writes (one tenant, 10% of the points closed at earlier epochs), then the
p50 of the exact, filtered search retrieval runs (``VectorIndex.search``: tenant + snapshot at
the current epoch, top 4), next to a numpy brute-force scan of the same float32 vectors (the
baseline), the same search at an old snapshot (the range-filter path), and the same index
stored as float32 instead of float16.

    flock /tmp/inherent-bench.lock .venv/bin/python -m bench.ingest
    flock /tmp/inherent-bench.lock .venv/bin/python -m bench.ingest --docs 400 --points 20000   # quick

The last line is one JSON object.
"""

import argparse
import json
import random
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from ingest import jobs
from ingest.embedding import bundled_model_dir
from provenance import truth
from provenance.models import OPEN_EPOCH
from provenance.settings import Settings
from provenance.vector_index import EdgeIndex, IndexPoint, close_vector_indexes


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=2000)
    p.add_argument(
        "--changed", type=float, default=0.05, help="fraction edited before the third run"
    )
    p.add_argument("--points", type=int, default=100_000)
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-float32", action="store_true", help="skip the float32 index comparison")
    return p.parse_args()


def vocabulary() -> list[str]:
    words = (bundled_model_dir() / "vocab.txt").read_text().split("\n")[2000:12000]
    return [w for w in words if w.isalpha() and len(w) >= 4]


def sentence(rng: random.Random, words: list[str]) -> str:
    return " ".join(rng.choice(words) for _ in range(rng.randint(6, 12))).capitalize() + "."


def write_corpus(
    folder: Path, count: int, rng: random.Random, words: list[str]
) -> dict[Path, list[list[str]]]:
    """Short Markdown documents: a heading and 2-4 paragraphs of 2-3 sentences."""
    docs = {}
    for n in range(count):
        paragraphs = [
            [sentence(rng, words) for _ in range(rng.randint(2, 3))]
            for _ in range(rng.randint(2, 4))
        ]
        path = folder / f"section-{n // 100:02d}" / f"doc-{n:05d}.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        docs[path] = paragraphs
        render(path, n, paragraphs)
    return docs


def render(path: Path, n: int, paragraphs: list[list[str]]) -> None:
    path.write_text(f"# Document {n}\n\n" + "\n\n".join(" ".join(p) for p in paragraphs) + "\n")


def timed_job(runtime: jobs.Runtime, folder: Path) -> tuple[float, jobs.JobStatus]:
    start = time.perf_counter()
    job_id = jobs.submit_ingestion(runtime, "bench", [folder], wait=True)
    elapsed = time.perf_counter() - start
    status = jobs.get_job(runtime.settings, job_id)
    if status.state != "succeeded":
        raise SystemExit(f"ingestion failed: {status.summary}")
    return elapsed, status


def bench_ingest(args: argparse.Namespace, workdir: Path) -> dict:
    rng = random.Random(args.seed)
    words = vocabulary()
    folder = workdir / "corpus"
    docs = write_corpus(folder, args.docs, rng, words)
    settings = Settings(data_dir=workdir / "data")
    rt = jobs.Runtime(settings)
    rt.embedder.embed(["warm up"])  # load the model before timing

    first_s, first = timed_job(rt, folder)
    with rt.sessions() as s:
        chunks = len(truth.chunks_as_of(s, "bench", truth.current_epoch(s, "bench")))
    print(
        f"first ingest: {args.docs} docs, {chunks} chunks in {first_s:.1f} s "
        f"({args.docs / first_s:.1f} docs/s, {chunks / first_s:.1f} chunks/s); {first.summary}"
    )

    unchanged_s, unchanged = timed_job(rt, folder)
    print(
        f"re-ingest unchanged: {unchanged_s:.2f} s ({first_s / unchanged_s:.1f}x faster); {unchanged.summary}"
    )

    edited = sorted(docs)[:: max(1, round(1 / args.changed))]
    for path in edited:
        paragraphs = docs[path]
        paragraphs[-1][-1] = sentence(rng, words)
        render(path, int(path.stem.split("-")[1]), paragraphs)
    changed_s, changed = timed_job(rt, folder)
    print(
        f"re-ingest {len(edited)} edited ({len(edited) / args.docs:.0%}): {changed_s:.2f} s "
        f"({first_s / changed_s:.1f}x faster); {changed.summary}"
    )
    if changed.summary["updated"] != len(edited) or unchanged.summary["unchanged"] != args.docs:
        raise SystemExit("the re-ingests did not see the expected changes")
    close_vector_indexes()
    return {
        "docs": args.docs,
        "chunks": chunks,
        "first_ingest_s": round(first_s, 2),
        "docs_per_s": round(args.docs / first_s, 1),
        "chunks_per_s": round(chunks / first_s, 1),
        "reingest_unchanged_s": round(unchanged_s, 3),
        "reingest_unchanged_speedup": round(first_s / unchanged_s, 1),
        "reingest_5pct_s": round(changed_s, 3),
        "reingest_5pct_docs": len(edited),
        "reingest_5pct_chunks_embedded": changed.summary["chunks_embedded"],
        "reingest_5pct_speedup": round(first_s / changed_s, 1),
    }


def random_points(
    count: int, dim: int, rng: np.random.Generator
) -> tuple[list[IndexPoint], np.ndarray]:
    vectors = rng.standard_normal((count, dim)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    points = []
    for i in range(count):
        # Sources of 4 chunks; every tenth source has an older, closed version.
        source, version = i // 4, 1
        valid_from, valid_to = 1 + source % 50, OPEN_EPOCH
        if source % 10 == 0:
            valid_to = valid_from + 10 + source % 7
        chunk = str(uuid.UUID(int=i + 1))
        points.append(
            IndexPoint(
                chunk,
                "bench",
                f"src-{source}",
                version,
                f"{i:064x}",
                valid_from,
                valid_to,
                vectors[i],
            )
        )
    return points, vectors


def p50_ms(run, queries: np.ndarray) -> float:
    run(queries[0])  # warm
    times = []
    for q in queries:
        start = time.perf_counter()
        run(q)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def bench_search(args: argparse.Namespace, workdir: Path, datatype: str) -> dict:
    rng = np.random.default_rng(args.seed)
    points, vectors = random_points(args.points, 384, rng)
    index = EdgeIndex(workdir / f"search-{datatype}", 384, datatype=datatype)
    start = time.perf_counter()
    index.upsert(points)
    index.flush()
    index.optimize()
    build_s = time.perf_counter() - start
    queries = rng.standard_normal((args.queries, 384)).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    current = 100
    hits = index.search("bench", queries[0], current, 4)
    assert len(hits) == 4 and all(h.valid_to == OPEN_EPOCH for h in hits)
    result = {
        "build_s": round(build_s, 1),
        "p50_ms": p50_ms(lambda q: index.search("bench", q, current, 4), queries),
        "p50_ms_old_snapshot": p50_ms(
            lambda q: index.search("bench", q, 20, 4), queries[: args.queries // 4]
        ),
    }
    index.close()
    if datatype == "float16":
        visible = np.array([p.valid_to == OPEN_EPOCH for p in points])
        open_vectors = vectors[visible]

        def brute_force(q):
            scores = open_vectors @ q
            top = np.argpartition(-scores, 4)[:4]
            return top[np.argsort(-scores[top])]

        result["numpy_p50_ms"] = p50_ms(brute_force, queries)
    return result


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="inherent-bench-") as tmp:
        workdir = Path(tmp)
        summary = bench_ingest(args, workdir)
        f16 = bench_search(args, workdir, "float16")
        print(
            f"search over {args.points} points (float16, the default): p50 {f16['p50_ms']:.2f} ms at the "
            f"current epoch, {f16['p50_ms_old_snapshot']:.2f} ms at an old snapshot; numpy float32 "
            f"brute force over the visible points: {f16['numpy_p50_ms']:.2f} ms; built in {f16['build_s']} s"
        )
        summary.update(
            search_points=args.points,
            search_p50_ms_100k=round(f16["p50_ms"], 2),
            search_p50_ms_old_snapshot=round(f16["p50_ms_old_snapshot"], 2),
            search_numpy_bruteforce_p50_ms=round(f16["numpy_p50_ms"], 2),
            search_vs_numpy=round(f16["numpy_p50_ms"] / f16["p50_ms"], 2),
        )
        if not args.skip_float32:
            f32 = bench_search(args, workdir, "float32")
            print(
                f"same index stored as float32: p50 {f32['p50_ms']:.2f} ms "
                f"({f32['p50_ms_old_snapshot']:.2f} ms at an old snapshot)"
            )
            summary["search_p50_ms_float32"] = round(f32["p50_ms"], 2)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
