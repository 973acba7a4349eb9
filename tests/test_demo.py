"""The README's run command works end to end on the embedded default."""

import pytest
from typer.testing import CliRunner

from gateway.cli import app

pytestmark = pytest.mark.slow


def test_demo_runs_green(tmp_path, monkeypatch):
    monkeypatch.setenv("INHERENT_DATA_DIR", str(tmp_path))
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
