"""What provenance costs a request: end-to-end latency through the API (retrieval, prompt
template, receipt with its audit leaf) against the same prompts sent to the engine directly.

Each prompt runs both ways, alternating, on the embedded default with the bundled model. The
overhead of a request is its API latency minus its own engine time and its query embedding
time, both from the response's Server-Timing header (the embedding is model work, reported on
its own); the same prompt run straight into the engine gives the baseline ratio. Last line:
one JSON object.

    .venv/bin/python -m bench.overhead [--requests 40] [--docs 300]
"""

import argparse
import asyncio
import json
import random
import shutil
import statistics
import tempfile
import time
from importlib import resources
from pathlib import Path

import httpx

from engine import SamplingParams
from gateway.app import create_app
from gateway.auth import create_key
from ingest import jobs
from provenance.db import session_scope
from provenance.migrate import ensure_schema
from provenance.settings import Settings

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
    settings = Settings(
        data_dir=data_dir, database_url="", qdrant_url="", redis_url="", enable_prefix_caching=False
    )
    ensure_schema(settings.sqlalchemy_url)
    write_corpus(data_dir / "corpus", args.docs)
    job = jobs.submit_ingestion(settings, "bench", [data_dir / "corpus"], wait=True)
    print(f"ingested: {jobs.get_job(settings, job).summary}")
    with session_scope(settings.sqlalchemy_url, write=True) as session:
        key = create_key(session, "bench", ["chat"]).secret
    app = create_app(settings)
    questions = [
        f"How do I change the {TOPICS[i % len(TOPICS)]} settings? ({i})"
        for i in range(args.requests)
    ]
    api_ms, direct_ms, embed_ms, receipt_ms, overhead_ms = [], [], [], [], []
    async with app.router.lifespan_context(app):
        services = app.state.services
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport,
            base_url="http://bench",
            headers={"Authorization": f"Bearer {key}"},
            timeout=600,
        ) as client:
            for i, question in enumerate([questions[0], *questions]):  # the first one warms up
                body = {
                    "model": "inherent",
                    "messages": [{"role": "user", "content": question}],
                    "temperature": 0,
                    "max_tokens": args.max_tokens,
                }
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
                embed_ms.append(timing["embed"])
                receipt_ms.append(timing["receipt"])
                overhead_ms.append(api * 1000 - timing["engine"] - timing["embed"])
                assert len(chunks) > 0
    shutil.rmtree(data_dir, ignore_errors=True)
    return {
        "requests": len(api_ms),
        "api_ms_p50": statistics.median(api_ms),
        "engine_direct_ms_p50": statistics.median(direct_ms),
        "query_embed_ms_p50": statistics.median(embed_ms),
        "provenance_overhead_ms_p50": statistics.median(overhead_ms),
        "provenance_overhead_ms_p99": percentile(overhead_ms, 99),
        "receipt_write_ms_p50": statistics.median(receipt_ms),
        "receipt_write_ms_p99": percentile(receipt_ms, 99),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument(
        "--docs", type=int, default=300, help="generated articles beside the demo corpus"
    )
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    result = asyncio.run(run(args))
    print(
        f"API p50 {result['api_ms_p50']:.1f} ms vs engine direct p50 {result['engine_direct_ms_p50']:.1f} ms "
        f"(ratio {result['api_ms_p50'] / result['engine_direct_ms_p50']:.3f}); query embedding p50 {result['query_embed_ms_p50']:.1f} ms"
    )
    print(
        f"provenance overhead beyond the embedding: p50 {result['provenance_overhead_ms_p50']:.2f} ms, "
        f"p99 {result['provenance_overhead_ms_p99']:.2f} ms (target p50 <= 5 ms); receipt write p50 {result['receipt_write_ms_p50']:.2f} ms"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
