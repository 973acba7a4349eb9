"""The console script lists its subcommands, manages keys, and never pretends."""

from typer.testing import CliRunner

from gateway.cli import app

SUBCOMMANDS = ["serve", "ingest", "ask", "replay", "jobs", "keys", "audit", "diagnose", "db", "demo"]


def test_help_lists_every_subcommand():
    result = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for name in SUBCOMMANDS:
        assert f" {name} " in result.stdout


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
