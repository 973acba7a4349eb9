"""The console script lists its subcommands, manages keys, and never pretends."""

import subprocess
import sys
import time
from pathlib import Path

from typer.testing import CliRunner

from gateway.cli import app

SUBCOMMANDS = ["serve", "ingest", "ask", "replay", "jobs", "keys", "audit", "diagnose", "db", "demo",
               "sources", "receipts"]


def test_help_lists_every_subcommand():
    result = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for name in SUBCOMMANDS:
        assert f" {name} " in result.stdout


def test_help_answers_within_a_second_without_the_heavy_stacks():
    """`inherent --help` imports the CLI app alone: torch, transformers and the database stack
    load only inside the commands that use them (each takes seconds on 2 busy cores)."""
    repo = Path(__file__).resolve().parents[1]
    probe = ("import sys; from gateway.cli import app; "
             "print(sorted({'torch', 'transformers', 'sqlalchemy', 'alembic'} & set(sys.modules)))")
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=repo, capture_output=True,
                            text=True, check=True)
    assert loaded.stdout.strip() == "[]"
    command = [sys.executable, "-c", "from gateway.cli import app; app()", "--help"]
    timings = []
    for _ in range(3):  # the best of three: a busy machine may stall any one start
        start = time.perf_counter()
        result = subprocess.run(command, cwd=repo, capture_output=True, text=True)
        timings.append(time.perf_counter() - start)
        assert result.returncode == 0 and "diagnose" in result.stdout
    assert min(timings) < 1.0, timings


def test_keys_create_prints_secret_once_and_rejects_bad_scope(tmp_path, monkeypatch):
    monkeypatch.setenv("INHERENT_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("INHERENT_DATABASE_URL", raising=False)
    from provenance.settings import get_settings

    get_settings.cache_clear()
    runner = CliRunner()
    created = runner.invoke(app, ["keys", "create", "--tenant", "acme", "--scope", "chat"])
    assert created.exit_code == 0, created.output
    secret = created.stdout.strip().splitlines()[-1]
    assert secret.startswith("ink_")
    listed = runner.invoke(app, ["keys", "list"], env={"COLUMNS": "200"})
    assert "acme" in listed.stdout and secret not in listed.stdout
    bad = runner.invoke(app, ["keys", "create", "--tenant", "acme", "--scope", "root"])
    assert bad.exit_code == 1 and "scopes must be" in bad.stderr and "Traceback" not in bad.output
    get_settings.cache_clear()


def test_version_flag_prints_the_package_version():
    from importlib.metadata import version

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout.strip() == f"inherent {version('inherent')}"


def test_db_upgrade_takes_the_revision_as_alembic_does(tmp_path, monkeypatch):
    monkeypatch.setenv("INHERENT_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("INHERENT_DATABASE_URL", raising=False)
    from provenance.settings import get_settings

    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(app, ["db", "upgrade", "head"])
        assert result.exit_code == 0, result.output
        assert "database at revision" in result.stdout
    finally:
        get_settings.cache_clear()


def test_serve_flags_become_settings_and_bootstrap_a_key(tmp_path, monkeypatch):
    from fastapi.testclient import TestClient

    from gateway.auth import authenticate
    from gateway.drain import DrainingServer
    from provenance.db import session_scope
    from provenance.settings import get_settings

    monkeypatch.setenv("INHERENT_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("INHERENT_DATABASE_URL", raising=False)
    get_settings.cache_clear()
    key_file = tmp_path / "key"
    key_file.write_text("sk-local-secret-123\n")
    ran = {}
    monkeypatch.setattr(DrainingServer, "run", lambda server: ran.update(config=server.config))
    import gateway.request_context

    monkeypatch.setattr(gateway.request_context, "configure_logging",
                        lambda level, json_logs: ran.update(logging=(level, json_logs)))
    try:
        result = CliRunner().invoke(app, [
            "serve", "--model", "/models/x.gguf", "--served-model-name", "my-model",
            "--api-key-file", str(key_file), "--host", "0.0.0.0", "--port", "9123",
            "--log-level", "debug", "--threads", "2", "--log-json"])
        assert result.exit_code == 0, result.output
        config = ran["config"]
        settings = config.app.state.settings
        assert (settings.engine.model, settings.served_model_name, settings.engine.num_threads) == (
            "/models/x.gguf", "my-model", 2)
        assert settings.log_json and settings.bootstrap_api_key == "sk-local-secret-123"
        assert (config.host, config.port, config.log_level) == ("0.0.0.0", 9123, "debug")
        assert ran["logging"] == ("debug", True)

        class NoModel:  # the lifespan's key bootstrap needs no model
            tracer = None

            async def start(self): ...

            async def stop(self): ...

        from gateway.app import create_app

        with TestClient(create_app(settings, services_factory=lambda s, r: NoModel())):
            pass
        with session_scope(settings.sqlalchemy_url) as session:
            principal = authenticate(session, "sk-local-secret-123")
        assert principal.tenant_id == "default"
        assert principal.scopes == {"chat", "admin", "audit"}
        bad = CliRunner().invoke(app, ["serve", "--log-level", "loud"])
        assert bad.exit_code == 1 and "log_level" in bad.stderr
    finally:
        get_settings.cache_clear()


def test_invalid_settings_and_an_unreachable_database_are_one_line_errors(tmp_path):
    """What an operator mistypes in the environment, or a database that cannot be opened, is
    named in one line with exit code 1: never a traceback."""
    repo = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-c", "from gateway.cli import run; run()", "db", "current"]
    base = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(repo)}
    cases = {
        "max_json_body_bytes": {"INHERENT_MAX_JSON_BODY_BYTES": "lots"},
        "ingest_allowed_roots": {"INHERENT_INGEST_ALLOWED_ROOTS": "[not json"},
        "cannot use the database": {"INHERENT_DATABASE_URL": f"sqlite:///{tmp_path}/no/such/dir/x.db"},
    }
    for expected, env in cases.items():
        result = subprocess.run(command, cwd=tmp_path, env={**base, **env}, capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 1, (env, result.stdout, result.stderr)
        assert expected in result.stderr and "error:" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr + result.stdout, result.stderr


def test_allowed_roots_read_like_path_or_as_json(monkeypatch):
    from provenance.settings import Settings

    monkeypatch.setenv("INHERENT_INGEST_ALLOWED_ROOTS", "/srv/docs:/srv/wiki")
    assert Settings().ingest_allowed_roots == [Path("/srv/docs"), Path("/srv/wiki")]
    monkeypatch.setenv("INHERENT_INGEST_ALLOWED_ROOTS", '["/srv/docs"]')
    assert Settings().ingest_allowed_roots == [Path("/srv/docs")]
    monkeypatch.setenv("INHERENT_INGEST_ALLOWED_ROOTS", "")
    assert Settings().ingest_allowed_roots == []
