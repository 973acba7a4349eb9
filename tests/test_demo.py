"""The README's run command works end to end on the embedded default."""

import pytest
from typer.testing import CliRunner

from gateway.auth import authenticate
from gateway.cli import app
from provenance.db import session_scope
from provenance.settings import Settings

pytestmark = pytest.mark.slow


def test_demo_runs_green(tmp_path, monkeypatch):
    monkeypatch.setenv("INHERENT_DATA_DIR", str(tmp_path))
    # The demo's few answers run one at a time: a quarter of the default KV cache holds them
    # and spares the seconds of zeroing 1.5 GB (test_replay runs the default size).
    monkeypatch.setenv("INHERENT_KV_CACHE_TOKENS", "8192")
    from provenance.settings import get_settings

    get_settings.cache_clear()
    result = CliRunner().invoke(app, ["demo"], env={"COLUMNS": "120"})
    get_settings.cache_clear()
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert out.count("receipt rcpt_") >= 4
    assert "verdict: identical" in out and "storage-plans.md v1: changed" in out
    assert "legacy-two-factor.md v1: deprecated" in out
    assert "+**Plus** costs 5 euros per month" in out
    assert "audit verify: intact" in out
    # The closing hint serves the demo's own data with its numerics and names a working audit key.
    # The lines after the rule that carries the heading.
    serve, link = out.split("Review these answers in the browser")[1].splitlines()[1:3]
    assert serve == f"INHERENT_DATA_DIR={tmp_path / 'demo'} INHERENT_BATCH_INVARIANT=true inherent serve"
    assert link.startswith("then open http://127.0.0.1:8000/review/ and sign in with the audit key ")
    with session_scope(Settings(data_dir=tmp_path / "demo", database_url="").sqlalchemy_url) as session:
        principal = authenticate(session, link.split()[-1])
    assert principal.scopes == {"audit"} and principal.tenant_id == "demo"
