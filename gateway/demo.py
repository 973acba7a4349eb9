"""``inherent demo``: the whole product on the embedded default, through the real HTTP API.

Ingest a handful of support articles, ask three questions (answers, citations, receipt ids),
update one article and deprecate another, replay an earlier receipt (verdict and drift), and
verify the audit log.
"""

import asyncio
import dataclasses
import shutil
import time
from importlib import resources
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from gateway.app import create_app
from gateway.auth import create_key
from gateway.client import in_process
from gateway.client import question as client_question
from gateway.settings import ServerSettings
from provenance.db import session_scope
from provenance.migrate import ensure_schema

QUESTIONS = [
    "How long does a password reset link stay valid?",
    "How much does the Plus plan cost and how much storage does it include?",
    "How do I turn on two-factor authentication?",
]
UPDATED_PLANS = (
    "costs 4 euros per month, includes 200 GB",
    "costs 5 euros per month, includes 500 GB",
)


def demo_settings(base: ServerSettings) -> ServerSettings:
    """A private embedded data dir under the configured one, fresh for every run; the engine in
    batch-invariant mode, so that replay can claim bit-identical answers."""
    data_dir = base.data_dir / "demo"
    shutil.rmtree(data_dir, ignore_errors=True)
    data_dir.mkdir(parents=True)
    return base.model_copy(
        update={"data_dir": data_dir, "database_url": "", "qdrant_url": "", "redis_url": "",
                "engine": dataclasses.replace(base.engine, batch_invariant=True)}
    )


def run_demo(base: ServerSettings, console: Console) -> int:
    return asyncio.run(_demo(demo_settings(base), console))


async def _demo(settings: ServerSettings, console: Console) -> int:
    started = time.perf_counter()
    corpus = settings.data_dir / "corpus"
    shutil.copytree(Path(str(resources.files("gateway") / "demo_corpus")), corpus)
    ensure_schema(settings.sqlalchemy_url)
    with session_scope(settings.sqlalchemy_url, write=True) as session:
        key = create_key(session, "demo", ["chat", "admin", "audit"], "demo").secret
        review_key = create_key(session, "demo", ["audit"], "review console").secret

    app = create_app(settings)
    with console.status("Loading the model and the embedder…"):
        lifespan = app.router.lifespan_context(app)
        await lifespan.__aenter__()
    try:
        services = app.state.services
        console.print(
            f"model [bold]{services.model_id}[/] weights blake3 {services.weights_hash[:16]}…"
        )
        async with in_process(app, key) as client:
            await ingest(client, console, corpus, "Ingesting the support articles")
            receipts = []
            for question in QUESTIONS:
                receipts.append(await ask(client, console, question))

            console.rule("The world changes")
            plans = corpus / "storage-plans.md"
            plans.write_text(plans.read_text().replace(*UPDATED_PLANS))
            console.print("updated storage-plans.md: Plus now costs 5 euros and includes 500 GB")
            await ingest(client, console, corpus, "Re-ingesting")
            await call(client, "POST", "/admin/sources/legacy-two-factor.md/deprecate")
            console.print("deprecated legacy-two-factor.md (SMS codes are retired)")
            await ask(client, console, QUESTIONS[1])

            console.rule(f"Replaying receipt {receipts[1]}")
            from gateway.terminal import print_replay

            print_replay(await call(client, "POST", f"/v1/receipts/{receipts[1]}/replay"))
            console.rule(f"Replaying receipt {receipts[2]}")
            print_replay(await call(client, "POST", f"/v1/receipts/{receipts[2]}/replay"))

            console.rule("Audit log")
            root = await call(client, "GET", "/v1/audit/root")
            console.print(f"{root['tree_size']} leaves, root {root['root']}")
    finally:
        await lifespan.__aexit__(None, None, None)
    from provenance import audit_log

    with session_scope(settings.sqlalchemy_url) as session:
        report = audit_log.verify(session)
    console.print(
        "audit verify: " + ("[green]intact[/]" if report.ok else f"[red]{report.problems}[/]")
    )
    console.print(f"demo finished in {time.perf_counter() - started:.1f} s")
    print_review_hint(console, settings, review_key)
    return 0 if report.ok else 1


def print_review_hint(console: Console, settings: ServerSettings, review_key: str) -> None:
    """How to see these answers in the review console: serve the demo's own data dir, with the
    demo's batch-invariant numerics so that its replays can still read identical."""
    console.rule("Review these answers in the browser")
    console.print(
        f"INHERENT_DATA_DIR={settings.data_dir} INHERENT_BATCH_INVARIANT=true inherent serve",
        soft_wrap=True,
    )
    console.print(
        f"then open http://{settings.host}:{settings.port}/review/ and sign in with the audit key "
        f"{review_key}",
        soft_wrap=True,
    )


async def call(client: httpx.AsyncClient, method: str, path: str, **kwargs) -> dict:
    response = await client.request(method, path, **kwargs)
    if response.status_code >= 400:
        raise RuntimeError(f"{method} {path} -> {response.status_code}: {response.text}")
    return response.json()


async def ingest(client: httpx.AsyncClient, console: Console, corpus: Path, label: str) -> None:
    # Uploaded as a tenant would: the API does not read server paths (SECURITY.md).
    files = [("files", (f.name, f.read_bytes())) for f in sorted(corpus.iterdir()) if f.is_file()]
    job = await call(client, "POST", "/admin/ingest", files=files)
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} sources"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(label, total=None)
        while not job["finished"]:
            progress.update(task, total=job["total_sources"] or None, completed=job["done_sources"])
            await asyncio.sleep(0.2)
            job = await call(client, "GET", f"/admin/jobs/{job['id']}")
    summary = {
        k: job["summary"].get(k, 0)
        for k in ("added", "updated", "unchanged", "deprecated", "deleted", "failed")
    }
    console.print(
        f"{label}: {job['state']} {summary}, {job['chunks_embedded']} chunks embedded, {job['chunks_skipped']} reused"
    )
    if job["state"] != "succeeded":
        raise RuntimeError(f"ingestion failed: {job['summary']}")


async def ask(client: httpx.AsyncClient, console: Console, question: str) -> str:
    from gateway.terminal import print_answer

    console.rule(question)
    reply = await call(
        client,
        "POST",
        "/v1/chat/completions",
        json=client_question(question, max_tokens=48),
    )
    print_answer(reply)
    return reply["receipt_id"]
