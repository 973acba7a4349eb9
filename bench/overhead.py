"""What provenance costs a request: end-to-end latency through the API (retrieval, prompt
template, receipt with its audit leaf) against the same prompts sent to the engine directly.

Each prompt runs both ways, alternating, on the embedded default with the bundled model. From the
response's Server-Timing header: the provenance overhead is the retrieval without the query
embedding (resolving the snapshot, vector search, visibility check, fitting the context budget)
plus the receipt write; everything the API adds is its latency minus its own engine time and
query embedding (the embedding is model work, reported on its own). The same prompt run
straight into the engine gives the baseline ratio. Last line: one JSON object.

Then, on a fresh embedded store, receipts are committed every 20 ms (through the API's
receipt writer) while an in-process ingestion of ``--ingest-docs`` (2,000) articles runs: their
p50/p99 say whether ingestion holds receipt writes up (target p99 <= 50 ms).

    .venv/bin/python -m bench.overhead [--requests 40] [--docs 300] [--ingest-docs 2000]
"""

import argparse
import asyncio
import json
import random
import shutil
import statistics
import tempfile
import threading
import time
from importlib import resources
from pathlib import Path

from bench import cpu
from engine import SamplingParams
from gateway.app import create_app
from gateway.auth import create_key
from gateway.client import in_process
from gateway.client import question as ask
from gateway.settings import ServerSettings
from ingest import jobs
from provenance.db import session_scope
from provenance.memory import CitedChunk
from provenance.migrate import ensure_schema
from provenance.receipt_writer import ReceiptWriter
from provenance.receipts import ReceiptRecord, new_receipt_id
from provenance.settings import Settings
from provenance.truth import ensure_tenant

TOPICS = ["billing", "sync", "sharing", "passwords", "storage", "security", "mobile app", "teams"]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def write_corpus(folder: Path, docs: int, seed: int = 7) -> None:
    shutil.copytree(Path(str(resources.files("gateway") / "demo_corpus")), folder)
    rng = random.Random(seed)
    for i in range(docs):
        topic = rng.choice(TOPICS)
        body = " ".join(
            f"Note {j} on {topic}: setting {rng.randint(1, 99)} controls {rng.choice(TOPICS)}."
            for j in range(12)
        )
        (folder / f"kb-{i:04d}.md").write_text(f"# {topic.title()} article {i}\n\n{body}\n")


def server_timing(header: str) -> dict[str, float]:
    parts = (item.strip().split(";dur=") for item in header.split(","))
    return {name: float(ms) for name, ms in parts}


async def run(args) -> dict:
    data_dir = Path(tempfile.mkdtemp(prefix="inherent-overhead-"))
    # No prefix cache: the second run of a prompt must not be cheaper than the first.
    settings = ServerSettings(
        data_dir=data_dir, database_url="", qdrant_url="", redis_url="", enable_prefix_caching=False
    )
    ensure_schema(settings.sqlalchemy_url)
    write_corpus(data_dir / "corpus", args.docs)
    job = jobs.submit_ingestion(jobs.Runtime(settings), "bench", [data_dir / "corpus"], wait=True)
    print(f"ingested: {jobs.get_job(settings, job).summary}")
    with session_scope(settings.sqlalchemy_url, write=True) as session:
        key = create_key(session, "bench", ["chat"]).secret
    app = create_app(settings)
    questions = [
        f"How do I change the {TOPICS[i % len(TOPICS)]} settings? ({i})"
        for i in range(args.requests)
    ]
    api_ms, direct_ms, overhead_ms, api_overhead_ms = [], [], [], []
    phase_ms: dict[str, list[float]] = {"embed": [], "retrieve": [], "prompt": [], "receipt": []}
    async with app.router.lifespan_context(app):
        services = app.state.services
        async with in_process(app, key) as client:
            for i, question in enumerate([questions[0], *questions]):  # the first one warms up
                body = ask(question, args.max_tokens)
                start = time.perf_counter()
                response = await client.post("/v1/chat/completions", json=body)
                api = time.perf_counter() - start
                response.raise_for_status()
                timing = server_timing(response.headers["Server-Timing"])
                chunks = response.json()["citations"]
                # The same prompt (same snapshot, so byte-identical), tokens and sampling,
                # straight into the engine.
                with session_scope(settings.sqlalchemy_url) as session:
                    messages = [{"role": "user", "content": question}]
                    ids = services.prepare(session, "bench", messages, True, None, None).prompt_ids
                params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
                start = time.perf_counter()
                async for _ in services.engine.generate(ids, params):
                    pass
                direct = time.perf_counter() - start
                if i == 0:
                    continue
                api_ms.append(api * 1000)
                direct_ms.append(direct * 1000)
                for phase, values in phase_ms.items():
                    values.append(timing[phase])
                overhead_ms.append(timing["retrieve"] + timing["receipt"])
                api_overhead_ms.append(api * 1000 - timing["engine"] - timing["embed"])
                assert len(chunks) > 0
    shutil.rmtree(data_dir, ignore_errors=True)
    return {
        "requests": len(api_ms),
        "api_ms_p50": statistics.median(api_ms),
        "engine_direct_ms_p50": statistics.median(direct_ms),
        "query_embed_ms_p50": statistics.median(phase_ms["embed"]),
        "provenance_overhead_ms_p50": statistics.median(overhead_ms),
        "provenance_overhead_ms_p99": percentile(overhead_ms, 99),
        "retrieve_ms_p50": statistics.median(phase_ms["retrieve"]),
        "prompt_ms_p50": statistics.median(phase_ms["prompt"]),
        "receipt_write_ms_p50": statistics.median(phase_ms["receipt"]),
        "receipt_write_ms_p99": percentile(phase_ms["receipt"], 99),
        "api_overhead_ms_p50": statistics.median(api_overhead_ms),
        "api_overhead_ms_p99": percentile(api_overhead_ms, 99),
    }


def synthetic_receipt(i: int) -> ReceiptRecord:
    """A receipt the size of a real one: a question, four retrieved chunks, a short answer."""
    chunks = [
        CitedChunk(rank=k + 1, score=0.5, chunk_id=f"c{i}-{k}", chunk_hash=f"{k:064x}",
                   source_id=f"kb-{k:04d}.md", version=1, ordinal=k, title=f"Article {k}",
                   char_start=0, char_end=800)
        for k in range(4)
    ]
    return ReceiptRecord(
        receipt_id=new_receipt_id(),
        tenant_id="bench",
        api_key_id=None,
        model_id="bench-model",
        weights_hash="0" * 64,
        messages=[{"role": "user", "content": f"How do I change the sync settings? ({i})"}],
        sampling={"temperature": 0, "max_tokens": 64},
        engine={"dtype": "float32"},
        retrieval={"query": "sync settings", "snapshot_epoch": 1, "embedding_model": "m",
                   "chunks": chunks},
        prompt_text="x" * 3000,
        prompt_token_count=700,
        template_version="bench",
        output_text="y" * 300,
        output_token_ids=list(range(64)),
        finish_reason="length",
    )


def receipts_under_ingestion(docs: int, interval_s: float = 0.02) -> dict:
    """Receipt commits (through the API's ReceiptWriter) while an in-process ingestion of
    ``docs`` articles runs on the same embedded SQLite store: their latency percentiles."""
    data_dir = Path(tempfile.mkdtemp(prefix="inherent-overhead-ingest-"))
    settings = Settings(data_dir=data_dir, database_url="", qdrant_url="", redis_url="")
    ensure_schema(settings.sqlalchemy_url)
    corpus = data_dir / "corpus"
    write_corpus(corpus, docs)
    with session_scope(settings.sqlalchemy_url, write=True) as session:
        ensure_tenant(session, "bench")
    writer = ReceiptWriter(settings.sqlalchemy_url, timeout_s=60)
    started = time.perf_counter()
    job = jobs.submit_ingestion(jobs.Runtime(settings), "bench", [corpus])
    latencies = []
    while not jobs.get_job(settings, job).finished:
        start = time.perf_counter()
        writer.submit(synthetic_receipt(len(latencies))).result()
        latencies.append((time.perf_counter() - start) * 1000)
        time.sleep(interval_s)
    ingest_s = time.perf_counter() - started
    status = jobs.get_job(settings, job)
    writer.close()
    shutil.rmtree(data_dir, ignore_errors=True)
    return {
        "ingest_docs": docs,
        "ingest_state": status.state,
        "ingest_s": ingest_s,
        "receipt_writes_during_ingest": len(latencies),
        "receipt_write_during_ingest_ms_p50": statistics.median(latencies),
        "receipt_write_during_ingest_ms_p99": percentile(latencies, 99),
        "receipt_write_during_ingest_ms_max": max(latencies),
    }


def receipts_from_threads(answers: int, receipts_each: int, max_group: int) -> dict:
    """``answers`` threads committing receipts back to back through one ReceiptWriter on a
    fresh SQLite store: receipts per second and each commit's latency as its answer sees it."""
    data_dir = Path(tempfile.mkdtemp(prefix="inherent-overhead-receipts-"))
    settings = Settings(data_dir=data_dir, database_url="", qdrant_url="", redis_url="")
    ensure_schema(settings.sqlalchemy_url)
    with session_scope(settings.sqlalchemy_url, write=True) as session:
        ensure_tenant(session, "bench")
    writer = ReceiptWriter(settings.sqlalchemy_url, 60, max_group=max_group)
    latencies: list[float] = []

    def answer(n: int) -> None:
        for k in range(receipts_each):
            start = time.perf_counter()
            writer.submit(synthetic_receipt(n * receipts_each + k)).result()
            latencies.append((time.perf_counter() - start) * 1000)

    started = time.perf_counter()
    threads = [threading.Thread(target=answer, args=(n,)) for n in range(answers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    writer.close()
    shutil.rmtree(data_dir, ignore_errors=True)
    return {"per_s": len(latencies) / elapsed, "p50": statistics.median(latencies),
            "p99": percentile(latencies, 99)}


def concurrent_receipts(answers: int, receipts_each: int = 25) -> dict:
    """Receipts of ``answers`` concurrent answers: group commit against one transaction per
    receipt (the baseline: the same writer with ``max_group=1``), alternated twice; the best
    run of each."""
    runs: dict[str, list[dict]] = {"group": [], "single": []}
    for mode in ["single", "group", "single", "group"]:
        max_group = 64 if mode == "group" else 1
        runs[mode].append(receipts_from_threads(answers, receipts_each, max_group))
    best = {mode: max(rs, key=lambda r: r["per_s"]) for mode, rs in runs.items()}
    return {
        "concurrent_answers": answers,
        "group_commit_receipts_per_s": best["group"]["per_s"],
        "single_commit_receipts_per_s": best["single"]["per_s"],
        "group_commit_ratio": best["group"]["per_s"] / best["single"]["per_s"],
        "group_commit_ms_p50": best["group"]["p50"],
        "group_commit_ms_p99": best["group"]["p99"],
        "single_commit_ms_p50": best["single"]["p50"],
        "single_commit_ms_p99": best["single"]["p99"],
    }


def report_requests(result: dict) -> None:
    print(
        f"API p50 {result['api_ms_p50']:.1f} ms vs engine direct p50 {result['engine_direct_ms_p50']:.1f} ms "
        f"(ratio {result['api_ms_p50'] / result['engine_direct_ms_p50']:.3f}); query embedding p50 {result['query_embed_ms_p50']:.1f} ms"
    )
    print(
        f"provenance overhead (retrieval without the query embedding, plus the receipt write): "
        f"p50 {result['provenance_overhead_ms_p50']:.2f} ms, p99 {result['provenance_overhead_ms_p99']:.2f} ms "
        f"(target p50 <= 2 ms): retrieval p50 {result['retrieve_ms_p50']:.2f} ms, receipt write p50 "
        f"{result['receipt_write_ms_p50']:.2f} ms; prompt template and tokenization p50 {result['prompt_ms_p50']:.2f} ms"
    )
    print(
        f"everything the API adds beyond the engine and the query embedding: p50 "
        f"{result['api_overhead_ms_p50']:.2f} ms, p99 {result['api_overhead_ms_p99']:.2f} ms"
    )


def report_concurrent_receipts(result: dict) -> None:
    print(
        f"receipts of {result['concurrent_answers']} concurrent answers: group commit "
        f"{result['group_commit_receipts_per_s']:.0f}/s (p50 {result['group_commit_ms_p50']:.2f} ms, "
        f"p99 {result['group_commit_ms_p99']:.2f} ms) vs one transaction each (baseline) "
        f"{result['single_commit_receipts_per_s']:.0f}/s (p50 {result['single_commit_ms_p50']:.2f} ms, "
        f"p99 {result['single_commit_ms_p99']:.2f} ms): ratio {result['group_commit_ratio']:.2f}"
    )


def report_ingestion(result: dict) -> None:
    print(
        f"receipt writes during a {result['ingest_docs']}-document ingestion "
        f"({result['ingest_state']}, {result['ingest_s']:.0f} s): "
        f"{result['receipt_writes_during_ingest']} writes, "
        f"p50 {result['receipt_write_during_ingest_ms_p50']:.2f} ms, "
        f"p99 {result['receipt_write_during_ingest_ms_p99']:.2f} ms (target p99 <= 50 ms), "
        f"max {result['receipt_write_during_ingest_ms_max']:.2f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=40, help="0 skips the API part")
    parser.add_argument(
        "--docs", type=int, default=300, help="generated articles beside the demo corpus"
    )
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--concurrent-answers", type=int, default=16,
        help="answers whose receipts are committed at once (0 skips that part)",
    )
    parser.add_argument(
        "--ingest-docs", type=int, default=2000,
        help="articles ingested while receipt writes are timed (0 skips that part)",
    )
    args = parser.parse_args()
    result: dict = {"cpu": cpu.describe()}
    # Each part prints its line as it ends; the JSON of all of them comes last.
    if args.requests:
        result.update(asyncio.run(run(args)))
        report_requests(result)
    if args.concurrent_answers:
        result.update(concurrent_receipts(args.concurrent_answers))
        report_concurrent_receipts(result)
    if args.ingest_docs:
        result.update(receipts_under_ingestion(args.ingest_docs))
        report_ingestion(result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
