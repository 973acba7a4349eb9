"""Soak: concurrent streaming clients for N minutes through the HTTP API of a real server.

A uvicorn server (``inherent serve``, the bundled model, the embedded default) runs in its own
process on 127.0.0.1. ``--clients`` clients (32) send chat completions back to back for
``--minutes`` (10): mixed prompt lengths, 10 % of them cancel mid-stream (the client closes the
connection), 5 % are malformed (each must get a 4xx), and half-way a re-ingestion of a changed
corpus runs through ``POST /admin/ingest``. Afterwards every receipt a request was promised
(completed, cancelled or failed, by its ``X-Receipt-Id``) is looked up, the KV blocks still held
are read from /metrics, and the audit log is verified. The server's RSS is sampled every few
seconds; ``rss_growth`` compares the end of the run with the end of its first minute (with the
middle of the run for runs shorter than two minutes). Last line: one JSON object.

    .venv/bin/python -m bench.soak [--minutes 10] [--clients 32]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import httpx
from sqlalchemy import select

from bench import cpu
from bench.servers import inherent_server
from gateway import sse
from gateway.auth import create_key
from gateway.client import question
from gateway.settings import ServerSettings
from provenance import audit_log
from provenance.db import session_scope
from provenance.migrate import ensure_schema
from provenance.models import Receipt

REPO = Path(__file__).resolve().parents[1]
CANCEL_SHARE, MALFORMED_SHARE = 0.10, 0.05
TOPICS = ["billing", "sync", "sharing", "passwords", "storage", "security", "mobile app", "teams"]
MALFORMED = [
    b'{"model": "inherent", "messages": [{"role": "user", "content": "hi"}',  # cut JSON
    b'{"model": "inherent", "messages": []}',
    b'{"model": "inherent", "messages": [{"role": "user", "content": "hi"}], "temperature": 9}',
    b'{"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}',
    b'{"model": "inherent", "messages": [{"role": "wizard", "content": "hi"}]}',
    b'{"model": "inherent", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}',
]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def write_corpus(folder: Path, docs: int, revision: int) -> None:
    """The demo articles plus generated ones; a later revision changes a tenth of them."""
    if not folder.exists():
        shutil.copytree(Path(str(resources.files("gateway") / "demo_corpus")), folder)
    rng = random.Random(7)
    for i in range(docs):
        topic = rng.choice(TOPICS)
        edited = revision if i % 10 == 0 else 0
        body = " ".join(
            f"Note {j} on {topic}: setting {rng.randint(1, 99) + edited} controls "
            f"{rng.choice(TOPICS)}."
            for j in range(12)
        )
        (folder / f"kb-{i:04d}.md").write_text(f"# {topic.title()} article {i}\n\n{body}\n")


@dataclass
class Tally:
    requests: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    status: dict[str, int] = field(default_factory=dict)
    errors_5xx: int = 0
    stream_errors: int = 0
    malformed_not_4xx: int = 0
    transport_errors: int = 0
    completion_tokens: int = 0
    promised: dict[str, str] = field(default_factory=dict)  # receipt id -> what the client did

    def count(self, kind: str, status: int) -> None:
        self.requests += 1
        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1
        self.status[str(status)] = self.status.get(str(status), 0) + 1
        if status >= 500:
            self.errors_5xx += 1


def prompt(rng: random.Random) -> str:
    """A question, sometimes behind a long pasted context: prompts from ~15 to ~700 tokens."""
    question = f"How do I change the {rng.choice(TOPICS)} settings?"
    padding = rng.choice([0, 0, 1, 4, 12, 30])
    context = " ".join(
        f"Line {i}: the {rng.choice(TOPICS)} page lists option {rng.randint(1, 999)}."
        for i in range(padding)
    )
    return f"{context}\n\n{question}" if context else question


async def one_request(client: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    roll = rng.random()
    if roll < MALFORMED_SHARE:
        response = await client.post(
            "/v1/chat/completions", content=rng.choice(MALFORMED),
            headers={"Content-Type": "application/json"},
        )
        tally.count("malformed", response.status_code)
        if not 400 <= response.status_code < 500:
            tally.malformed_not_4xx += 1
        return
    cancel = roll < MALFORMED_SHARE + CANCEL_SHARE
    body = question(prompt(rng), temperature=rng.choice([0, 0.7]), max_tokens=rng.randint(8, 64),
                    stream=True, stream_options={"include_usage": True})
    kind = "cancelled" if cancel else "stream"
    stop_after = rng.randint(1, 4)
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        tally.count(kind, response.status_code)
        if response.status_code != 200:
            await response.aread()
            return
        receipt_id = response.headers["X-Receipt-Id"]
        events = 0
        async for line in response.aiter_lines():
            data = sse.payload(line)
            if data is None:
                continue
            events += 1
            if "error" in data:
                tally.stream_errors += 1
                if "receipt_id" in data:
                    tally.promised[receipt_id] = "failed"
                return
            if data.get("usage"):
                tally.completion_tokens += data["usage"]["completion_tokens"]
            if cancel and events >= stop_after:
                break  # leaving the block closes the connection mid-stream
        tally.promised[receipt_id] = kind


async def client_loop(client, seed: int, deadline: float, tally: Tally) -> None:
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        try:
            await one_request(client, rng, tally)
        except httpx.HTTPError:
            tally.transport_errors += 1


async def ingest(client: httpx.AsyncClient, corpus: Path) -> dict:
    response = await client.post("/admin/ingest", json={"paths": [str(corpus)]})
    response.raise_for_status()
    job_id = response.json()["id"]
    while True:
        status = (await client.get(f"/admin/jobs/{job_id}")).json()
        if status["finished"]:
            return status
        await asyncio.sleep(0.5)


async def sample_rss(pid: int, samples: list[tuple[float, int]], start: float, stop: asyncio.Event):
    while not stop.is_set():
        samples.append((time.monotonic() - start, rss_bytes(pid)))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 5)


async def kv_blocks_in_use(client: httpx.AsyncClient, num_blocks: int) -> int:
    text = (await client.get("/metrics")).text
    usage = next(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("inherent:kv_cache_usage_perc")
    )
    return round(usage * num_blocks)


async def soak(args, base_url: str, key: str, pid: int, corpus: Path, num_blocks: int) -> dict:
    tally = Tally()
    headers = {"Authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=args.clients + 8)
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=600, limits=limits
    ) as client:
        first = await ingest(client, corpus)
        print(f"ingested: {first['summary']}", flush=True)
        samples: list[tuple[float, int]] = []
        stop = asyncio.Event()
        start = time.monotonic()
        sampler = asyncio.create_task(sample_rss(pid, samples, start, stop))
        duration = args.minutes * 60
        clients = [
            asyncio.create_task(client_loop(client, seed, start + duration, tally))
            for seed in range(args.clients)
        ]
        await asyncio.sleep(duration / 2)
        write_corpus(corpus, args.docs, revision=1)
        second = await ingest(client, corpus)
        print(f"re-ingested mid-run: {second['state']} {second['summary']}", flush=True)
        await asyncio.gather(*clients)
        stop.set()
        await sampler
        end_rss = rss_bytes(pid)
        await asyncio.sleep(1)  # the engine retires the last aborts at its next step
        blocks = await kv_blocks_in_use(client, num_blocks)
    baseline_at = 60 if args.minutes >= 2 else duration / 2
    baseline = next((rss for t, rss in samples if t >= baseline_at), samples[-1][1])
    return {
        "tally": tally,
        "reingest_state": second["state"],
        "kv_blocks_in_use_end": blocks,
        "rss_baseline_mb": baseline / 2**20,
        "rss_end_mb": end_rss / 2**20,
        "rss_growth": (end_rss - baseline) / baseline,
        "duration_s": time.monotonic() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--docs", type=int, default=200, help="generated articles to ingest")
    parser.add_argument("--keep", action="store_true", help="keep the data directory")
    args = parser.parse_args()

    data_dir = Path(tempfile.mkdtemp(prefix="inherent-soak-"))
    settings = ServerSettings(data_dir=data_dir, database_url="", qdrant_url="", redis_url="")
    ensure_schema(settings.sqlalchemy_url)
    with session_scope(settings.sqlalchemy_url, write=True) as session:
        key = create_key(session, "soak", ["chat", "admin", "audit"]).secret
    corpus = data_dir / "corpus"
    write_corpus(corpus, args.docs, revision=0)
    # The re-ingestion reads the corpus by path, as an operator's job would: allow its folder.
    with inherent_server(data_dir, extra_env={
            "INHERENT_INGEST_ALLOWED_ROOTS": json.dumps([str(corpus)])}) as server:
        num_blocks = settings.engine.num_kv_blocks
        run = asyncio.run(soak(args, server.base_url, key, server.pid, corpus, num_blocks))

    tally: Tally = run["tally"]
    with session_scope(settings.sqlalchemy_url) as session:
        stored = dict(session.execute(select(Receipt.id, Receipt.status)).all())
        report = audit_log.verify(session)
    missing = [r for r in tally.promised if r not in stored]
    statuses: dict[str, int] = {}
    for receipt_id, kind in tally.promised.items():
        if receipt_id in stored:
            name = f"{kind}->{stored[receipt_id]}"
            statuses[name] = statuses.get(name, 0) + 1
    result = {
        "minutes": args.minutes,
        "clients": args.clients,
        "requests": tally.requests,
        "by_kind": tally.by_kind,
        "http_status": tally.status,
        "errors_5xx": tally.errors_5xx,
        "stream_errors": tally.stream_errors,
        "transport_errors": tally.transport_errors,
        "malformed_not_4xx": tally.malformed_not_4xx,
        "receipts_expected": len(tally.promised),
        "receipts_missing": len(missing),
        "receipt_statuses": statuses,
        "completion_tokens": tally.completion_tokens,
        "tokens_per_s": tally.completion_tokens / run["duration_s"],
        "reingest_state": run["reingest_state"],
        "kv_blocks_in_use_end": run["kv_blocks_in_use_end"],
        "rss_baseline_mb": round(run["rss_baseline_mb"], 1),
        "rss_end_mb": round(run["rss_end_mb"], 1),
        "rss_growth": round(run["rss_growth"], 4),
        "audit_intact": report.ok,
        "audit_leaves": report.size,
        "cpu": cpu.describe(),
    }
    if not args.keep:
        shutil.rmtree(data_dir, ignore_errors=True)
    print(
        f"{tally.requests} requests in {run['duration_s']:.0f} s: {tally.errors_5xx} 5xx, "
        f"{len(missing)} receipts missing of {len(tally.promised)}, "
        f"{run['kv_blocks_in_use_end']} KV blocks held at the end, RSS growth "
        f"{run['rss_growth']:+.1%}, audit {'intact' if report.ok else 'BROKEN'}"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
