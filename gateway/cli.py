"""The ``inherent`` command line: serve the API, ingest, ask, replay, audit and operate.

Each command imports what it uses when it runs: ``inherent --help`` must answer at once, and
the database, settings and model stacks (torch above all) take seconds to import."""

import json
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from gateway.terminal import console, print_replay, print_sources

if TYPE_CHECKING:
    from provenance.settings import Settings

app = typer.Typer(
    help="Inherent: fast, accountable LLM answers.", no_args_is_help=True, add_completion=False
)
db_app = typer.Typer(help="Database schema (Alembic chain in migrations/).", no_args_is_help=True)
keys_app = typer.Typer(help="API keys: each bound to a tenant and scopes.", no_args_is_help=True)
audit_app = typer.Typer(help="The tamper-evident audit log.", no_args_is_help=True)


def print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"inherent {version('inherent')}")
        raise typer.Exit()


@app.callback()
def main(
    _version: Annotated[
        bool | None,
        typer.Option("--version", callback=print_version, is_eager=True,
                     help="Print the version and exit."),
    ] = None,
) -> None:
    """Inherent: fast, accountable LLM answers."""


app.add_typer(db_app, name="db")
app.add_typer(keys_app, name="keys")
app.add_typer(audit_app, name="audit")

err_console = Console(stderr=True)


def fail(message: str, code: int = 1) -> None:
    err_console.print(f"[bold red]error:[/] {message}", soft_wrap=True)  # whole, for grep
    raise typer.Exit(code)


def environment_settings(kind: "type[Settings] | None" = None) -> "Settings":
    """This process's settings (``kind``: the API's tree); an invalid ``INHERENT_*`` value is a
    one-line error naming it, not a traceback."""
    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    from provenance.settings import Settings, get_settings

    try:
        return get_settings(kind or Settings)
    except SettingsError as exc:
        fail(f"invalid settings: {exc}: {exc.__cause__}" if exc.__cause__ else str(exc))
    except ValidationError as exc:
        fail(f"invalid settings: {exc}")


def ready_settings(settings: "Settings | None" = None) -> "Settings":
    """Settings (the environment's, unless given) with the data directory made and the schema
    at head (migrated here only where ``migrate.ready_schema`` allows it; otherwise a clear
    refusal)."""
    from provenance import migrate

    settings = settings or environment_settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    try:
        migrate.ready_schema(settings)
    except migrate.SchemaMismatch as exc:
        fail(str(exc))
    return settings


@db_app.command("upgrade")
def db_upgrade(
    revision: Annotated[str, typer.Argument(help="Target revision, as Alembic names it.")] = "head",
) -> None:
    """Apply migrations up to REVISION (default: head)."""
    from provenance import migrate

    settings = environment_settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    migrate.upgrade(settings.sqlalchemy_url, revision)
    console.print(f"database at revision {migrate.current_revision(settings.sqlalchemy_url)}")


@db_app.command("downgrade")
def db_downgrade(revision: str) -> None:
    """Revert migrations down to REVISION ('base' removes every table)."""
    from provenance import migrate

    settings = environment_settings()
    migrate.downgrade(settings.sqlalchemy_url, revision)
    console.print(
        f"database at revision {migrate.current_revision(settings.sqlalchemy_url) or 'base'}"
    )


@db_app.command("current")
def db_current() -> None:
    """Print the database's revision and the chain's head."""
    from provenance import migrate

    url = environment_settings().sqlalchemy_url
    console.print(
        f"current: {migrate.current_revision(url) or 'base'}  head: {migrate.head_revision(url)}"
    )


@keys_app.command("create")
def keys_create(
    tenant: Annotated[str, typer.Option(help="Tenant the key acts for (created on first use).")],
    scope: Annotated[list[str], typer.Option(help="chat, admin or audit; repeat for several.")],
    name: str = "",
) -> None:
    """Create an API key and print its secret once."""
    from gateway.auth import create_key
    from provenance.db import session_scope

    settings = ready_settings()
    try:
        with session_scope(settings.sqlalchemy_url, write=True) as session:
            created = create_key(session, tenant, scope, name)
    except ValueError as exc:
        fail(str(exc))
    console.print(
        f"key id {created.key_id} for tenant {created.tenant_id}, scopes {', '.join(created.scopes)}"
    )
    console.print("secret (shown once, store it now):")
    typer.echo(created.secret)


@keys_app.command("list")
def keys_list(tenant: str | None = None) -> None:
    """List keys (never their secrets)."""
    from gateway.auth import list_keys
    from provenance.db import session_scope

    settings = ready_settings()
    table = Table("key id", "tenant", "scopes", "created", "revoked")
    with session_scope(settings.sqlalchemy_url) as session:
        for key in list_keys(session, tenant):
            table.add_row(
                key.id,
                key.tenant_id,
                ",".join(key.scopes),
                f"{key.created_at:%Y-%m-%d %H:%M}",
                "yes" if key.revoked_at else "",
            )
    console.print(table)


@keys_app.command("revoke")
def keys_revoke(key_id: str) -> None:
    """Revoke a key by id."""
    from gateway.auth import revoke_key
    from provenance.db import session_scope

    settings = ready_settings()
    with session_scope(settings.sqlalchemy_url, write=True) as session:
        if not revoke_key(session, key_id):
            fail(f"no active key with id {key_id}")
    console.print(f"revoked {key_id}")


@audit_app.command("root")
def audit_root(
    tenant: Annotated[str | None, typer.Option(help="One tenant's log (default: every tenant's).")] = None,
) -> None:
    """Print each tenant's audit log size and Merkle root (publish them to detect later rewrites)."""
    from provenance import audit_log
    from provenance.db import session_scope

    settings = ready_settings()
    with session_scope(settings.sqlalchemy_url) as session:
        tenants = [tenant] if tenant else audit_log.tenants(session)
        roots = {t: audit_log.root(session, t) for t in tenants}
    typer.echo(json.dumps({t: {"tree_size": size, "root": root.hex()} for t, (size, root) in roots.items()}))


@audit_app.command("verify")
def audit_verify(
    root: Annotated[
        list[str] | None,
        typer.Option(help="A tenant's root published earlier, as TENANT:SIZE:HEX; repeat for several."),
    ] = None,
) -> None:
    """Recompute every leaf and subtree from the database; name any receipt or event edited,
    deleted or reordered."""
    from provenance import audit_log
    from provenance.db import session_scope

    published: dict[str, tuple[int, str]] = {}
    for given in root or []:
        tenant, _, rest = given.rpartition(":")
        tenant, _, size = tenant.rpartition(":")
        if not tenant or not size.isdigit() or len(rest) != 64:
            fail("--root must look like TENANT:SIZE:HEX (64 hex digits)")
        published[tenant] = (int(size), rest)
    settings = ready_settings()
    with session_scope(settings.sqlalchemy_url) as session:
        report = audit_log.verify(session, published)
    if report.ok:
        console.print(
            f"[green]audit log intact[/]: {report.size} leaves in {len(report.trees)} tenant logs"
        )
        for tenant, (size, digest) in sorted(report.trees.items()):
            console.print(f"  {tenant}: {size} leaves, root {digest}")
        return
    for problem in report.problems:
        err_console.print(f"[red]TAMPERED[/] {problem}")
    raise typer.Exit(1)


@audit_app.command("verify-bundle")
def audit_verify_bundle(
    path: Annotated[Path, typer.Argument(help="An incident bundle exported by the review console.")],
    root: Annotated[
        str | None, typer.Option(help="Also require this published root, as SIZE:HEX.")
    ] = None,
) -> None:
    """Check an incident bundle offline: receipt, inclusion proof, root and checksum."""
    from provenance.incident import verify_bundle

    try:
        raw = path.read_bytes()
    except OSError as exc:
        fail(f"cannot read {path}: {exc.strerror}")
    report = verify_bundle(raw)
    if root and report.ok and root != f"{report.tree_size}:{report.root}":
        report.problems.append(
            f"the bundle's root {report.tree_size}:{report.root} is not the published {root}"
        )
    if report.ok:
        console.print(
            f"[green]bundle verified[/]: receipt {report.receipt_id} is leaf of the audit tree "
            f"of {report.tree_size} leaves with root {report.root}; replay verdict {report.verdict}",
            soft_wrap=True,  # hashes stay whole, for grep and copy
        )
        return
    for problem in report.problems:
        err_console.print(f"[red]INVALID[/] {problem}", soft_wrap=True)
    raise typer.Exit(1)


@app.command()
def serve(
    model: Annotated[str | None, typer.Option(
        help="A GGUF file or a Hugging Face checkpoint directory (INHERENT_MODEL_PATH).")] = None,
    served_model_name: Annotated[str | None, typer.Option(
        help="The model's name in the API (INHERENT_SERVED_MODEL_NAME).")] = None,
    api_key: Annotated[str | None, typer.Option(
        help="A key with every scope for single-tenant use (INHERENT_API_KEY; "
             "INHERENT_API_KEY_FILE reads it from a file).")] = None,
    api_key_file: Annotated[Path | None, typer.Option(
        help="A file holding that key (INHERENT_API_KEY_FILE).")] = None,
    host: Annotated[str | None, typer.Option(help="Bind address (INHERENT_HOST).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (INHERENT_PORT).")] = None,
    log_level: Annotated[str | None, typer.Option(
        help="critical, error, warning, info or debug (INHERENT_LOG_LEVEL).")] = None,
    log_json: Annotated[bool | None, typer.Option(
        "--log-json/--no-log-json", help="One JSON object per log line (INHERENT_LOG_JSON).")
    ] = None,
    threads: Annotated[int | None, typer.Option(
        help="CPU threads for the model (INHERENT_THREADS).")] = None,
) -> None:
    """Run the HTTP API (OpenAI-compatible chat with receipts, replay, admin)."""
    import uvicorn

    from gateway.app import create_app
    from gateway.drain import DrainingServer
    from gateway.request_context import configure_logging

    settings = serve_settings(
        model_path=model, served_model_name=served_model_name, api_key=api_key,
        api_key_file=str(api_key_file) if api_key_file else None, host=host, port=port,
        log_level=log_level, log_json=log_json, threads=threads,
    )
    configure_logging(settings.log_level, settings.log_json)
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=None,  # uvicorn's loggers reach our handler: request ids, JSON
        # The drain already waited up to shutdown_grace_s for requests in flight; this only
        # bounds what uvicorn's own shutdown waits after it.
        timeout_graceful_shutdown=5,
    )
    DrainingServer(config, app.state.drain).run()


def serve_settings(**flags) -> "Settings":
    """The settings with the flags given on the command line in place of theirs."""
    from pydantic import ValidationError

    from gateway.settings import ServerSettings

    given = {name: value for name, value in flags.items() if value is not None}
    try:
        settings = ServerSettings(**{**environment_settings(ServerSettings).model_dump(), **given})
    except ValidationError as exc:
        fail(str(exc))
    if settings.api_key_file and not Path(settings.api_key_file).is_file():
        fail(f"--api-key-file: no such file: {settings.api_key_file}")
    return ready_settings(settings)


ServerUrl = Annotated[
    str, typer.Option("--url", envvar="INHERENT_URL", help="The server's base URL.")
]
ApiKeyOption = Annotated[
    str, typer.Option("--key", envvar="INHERENT_API_KEY", help="An API key (or INHERENT_API_KEY).")
]


def call_api(method: str, url: str, key: str, path: str, **kwargs) -> dict:
    """One request to a running server; an error body or a refused connection becomes a message."""
    import httpx

    try:
        response = httpx.request(
            method,
            url.rstrip("/") + path,
            headers={"Authorization": f"Bearer {key}"},
            timeout=600,
            **kwargs,
        )
    except httpx.HTTPError as exc:
        fail(f"cannot reach {url}: {exc} (start it with 'inherent serve')")
    try:
        payload = response.json()
    except ValueError:
        fail(f"{response.status_code} from the server: {response.text[:200]}")
    if response.status_code >= 400:
        fail(f"{response.status_code}: {payload.get('error', {}).get('message', payload)}")
    return payload


JsonOption = Annotated[bool, typer.Option("--json", help="Print the server's JSON answer.")]


@app.command()
def ask(
    question: str,
    url: ServerUrl = "http://127.0.0.1:8000",
    key: ApiKeyOption = "",
    snapshot: Annotated[int | None, typer.Option(help="Pin retrieval to this epoch.")] = None,
    max_tokens: int = 256,
    as_json: JsonOption = False,
) -> None:
    """Ask a question against the running server; print the answer as it comes, its citations
    and receipt id (--json: the whole completion, once it is done)."""
    from gateway.client import question as ask_body

    body = ask_body(question, max_tokens,
                    inherent={"snapshot": snapshot} if snapshot is not None else {})
    if as_json:
        reply = call_api("POST", url, key, "/v1/chat/completions", json=body)
        typer.echo(json.dumps(reply, indent=2, ensure_ascii=False))
        return
    final = stream_answer(url, key, {**body, "stream": True})
    print_sources(final)


def stream_answer(url: str, key: str, body: dict) -> dict:
    """Print the answer's tokens as they arrive; return the last chunk (citations, receipt)."""
    import sys

    import httpx

    from gateway import sse

    final: dict = {}
    try:
        with httpx.stream(
            "POST", url.rstrip("/") + "/v1/chat/completions", json=body, timeout=600,
            headers={"Authorization": f"Bearer {key}"},
        ) as response:
            if response.status_code >= 400:
                response.read()
                try:
                    message = response.json().get("error", {}).get("message", response.text)
                except ValueError:
                    message = response.text[:200]
                fail(f"{response.status_code}: {message}")
            for line in response.iter_lines():
                chunk = sse.payload(line)
                if chunk is None:
                    continue
                if "error" in chunk:
                    fail(chunk["error"]["message"])
                for choice in chunk.get("choices", []):
                    sys.stdout.write(choice["delta"].get("content", ""))
                    sys.stdout.flush()
                if "receipt_id" in chunk:
                    final = chunk
    except httpx.HTTPError as exc:
        fail(f"cannot reach {url}: {exc} (start it with 'inherent serve')")
    sys.stdout.write("\n")
    return final


@app.command()
def replay(
    receipt_id: str,
    url: ServerUrl = "http://127.0.0.1:8000",
    key: ApiKeyOption = "",
    as_json: JsonOption = False,
) -> None:
    """Replay a receipt: same pinned context, model and sampling; print the verdict and the drift."""
    result = call_api("POST", url, key, f"/v1/receipts/{receipt_id}/replay")
    if as_json:
        typer.echo(json.dumps(result, indent=2, ensure_ascii=False))
        return
    print_replay(result)


@app.command()
def receipts(
    url: ServerUrl = "http://127.0.0.1:8000",
    key: ApiKeyOption = "",
    since: Annotated[str | None, typer.Option(help="ISO 8601 time: receipts at or after it.")] = None,
    limit: int = 100,
    as_json: JsonOption = False,
) -> None:
    """List your tenant's receipts, oldest first (scope audit)."""
    params = {"limit": limit, **({"since": since} if since else {})}
    listed = call_api("GET", url, key, "/v1/receipts", params=params)
    if as_json:
        typer.echo(json.dumps(listed, indent=2))
        return
    table = Table("receipt", "status", "created", "model", "snapshot")
    for r in listed["data"]:
        table.add_row(r["id"], r["status"], r["created_at"], r["model"], str(r["snapshot_epoch"]))
    console.print(table)


@app.command()
def sources(
    url: ServerUrl = "http://127.0.0.1:8000",
    key: ApiKeyOption = "",
    as_json: JsonOption = False,
) -> None:
    """List your tenant's sources with their newest version and status (scope admin)."""
    listed = call_api("GET", url, key, "/admin/sources")
    if as_json:
        typer.echo(json.dumps(listed, indent=2))
        return
    table = Table("source", "version", "status", "kind", "uri")
    for source in listed["data"]:
        latest = source["latest"]
        table.add_row(source["source_id"], str(latest["version"]), latest["status"],
                      source["kind"], source["uri"])
    console.print(table)


TenantOption = Annotated[str, typer.Option(help="The tenant whose sources these are.")]


@app.command()
def ingest(
    paths: Annotated[list[Path], typer.Argument(help="Files or folders (walked recursively).")],
    tenant: TenantOption = "default",
    cleanup: Annotated[
        bool, typer.Option("--cleanup", help="Delete (tombstone) sources no longer under PATHS.")
    ] = False,
    prefix: Annotated[str, typer.Option(help="Prefix for source ids derived from paths.")] = "",
) -> None:
    """Ingest files and folders into the truth store and the vector index, with a progress bar."""
    from ingest import jobs as ingest_jobs

    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        fail(f"not found: {', '.join(missing)}")
    settings = ready_settings()
    job_id = ingest_jobs.submit_ingestion(
        ingest_jobs.Runtime(settings), tenant, paths, "full" if cleanup else None, prefix=prefix
    )
    status = follow_job(settings, job_id)
    print_job(status)
    if status.state != "succeeded":
        raise typer.Exit(1)


def follow_job(settings: "Settings", job_id: str):
    """Poll a job's row until it ends, drawing its progress."""
    import time

    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    from ingest import jobs as ingest_jobs

    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[chunks]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(f"job {job_id[:8]}", total=None, chunks="")
        while True:
            status = ingest_jobs.get_job(settings, job_id)
            progress.update(
                task,
                total=status.total_sources or None,
                completed=status.done_sources,
                chunks=f"{status.chunks_embedded} embedded, {status.chunks_skipped} reused",
            )
            if status.finished:
                return status
            time.sleep(0.2)


def print_job(status) -> None:
    keys = ("added", "updated", "unchanged", "deprecated", "deleted", "failed", "skipped")
    summary = {k: status.summary.get(k, 0) for k in keys}
    style = "green" if status.state == "succeeded" else "red"
    console.print(f"job {status.id}: [{style}]{status.state}[/] {json.dumps(summary)}")
    console.print(
        f"  sources {status.done_sources}/{status.total_sources}, chunks embedded {status.chunks_embedded}, reused {status.chunks_skipped}"
    )
    for source, reason in sorted(status.errors.items()):
        console.print(f"  [red]failed[/] {source}: {reason}")
    skipped = Counter(Path(s).suffix or "(no extension)" for s in status.summary.get("skipped_sources", {}))
    if skipped:
        types = ", ".join(f"{suffix} {n}" for suffix, n in skipped.most_common())
        console.print(f"  [yellow]skipped[/] (unsupported types): {types}")
    if status.summary.get("error"):
        console.print(f"  [red]error[/] {status.summary['error']}")


@app.command()
def jobs(
    job_id: Annotated[
        str | None, typer.Argument(help="Show one job; without it, list recent jobs.")
    ] = None,
    tenant: Annotated[str | None, typer.Option(help="Only this tenant's jobs.")] = None,
    limit: int = 20,
    as_json: Annotated[bool, typer.Option("--json", help="Print the jobs as JSON.")] = False,
) -> None:
    """List ingestion jobs and their progress, or show one."""
    from dataclasses import asdict

    from ingest import jobs as ingest_jobs

    settings = ready_settings()
    if job_id:
        status = ingest_jobs.get_job(settings, job_id)
        if status is None:
            fail(f"no job {job_id}")
        if as_json:
            typer.echo(json.dumps(asdict(status), indent=2, default=str))
            return
        print_job(status)
        return
    if as_json:
        listed = ingest_jobs.list_jobs(settings, tenant, limit)
        typer.echo(json.dumps([asdict(s) for s in listed], indent=2, default=str))
        return
    table = Table("job", "tenant", "state", "sources", "embedded", "reused", "created")
    for status in ingest_jobs.list_jobs(settings, tenant, limit):
        table.add_row(
            status.id,
            status.tenant_id,
            status.state,
            f"{status.done_sources}/{status.total_sources}",
            str(status.chunks_embedded),
            str(status.chunks_skipped),
            f"{status.created_at:%Y-%m-%d %H:%M:%S}",
        )
    console.print(table)


@app.command()
def diagnose(
    source: Annotated[
        str,
        typer.Argument(
            help="A bench result file (JSON) or a metrics URL (http://host:port/metrics)."
        ),
    ],
    as_json: Annotated[bool, typer.Option("--json", help="Print the full report as JSON.")] = False,
    token: Annotated[
        str | None,
        typer.Option(
            "--token",
            envvar="INHERENT_METRICS_TOKEN",
            help="For a metrics URL: the server's metrics token, or an API key with the audit scope.",
        ),
    ] = None,
) -> None:
    """Say which phase owns the latency (queue, prefill, decode, interference), with the numbers."""
    from engine.diagnosis import from_source

    try:
        reports = from_source(source, token)
    except ValueError as exc:
        fail(f"cannot diagnose {source}: {exc}")
    if as_json:
        typer.echo(json.dumps(reports, indent=2, default=str))
        return
    for name, report in reports.items():
        console.rule(str(name))
        console.print(report["verdict"])


@app.command()
def demo() -> None:
    """Ingest a small corpus, ask, update an article, replay: the whole product in two minutes."""
    from gateway.demo import run_demo
    from gateway.settings import ServerSettings

    raise typer.Exit(run_demo(environment_settings(ServerSettings), console))


def run() -> None:
    """The ``inherent`` console script: the app, with a database it cannot reach (a missing
    data directory, a server that is down) answered by one line instead of a traceback."""
    try:
        app()
    except Exception as exc:
        from sqlalchemy.exc import OperationalError

        if not isinstance(exc, OperationalError):
            raise
        err_console.print(f"[bold red]error:[/] cannot use the database: {exc.orig}",
                          soft_wrap=True)
        raise SystemExit(1) from None
