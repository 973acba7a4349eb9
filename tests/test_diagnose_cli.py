"""`inherent diagnose` traces "it's slow" to a phase, from a bench file or a metrics endpoint."""

import json

from prometheus_client import CollectorRegistry, generate_latest
from typer.testing import CliRunner

from engine.metrics import EngineMetrics
from gateway.cli import app
from gateway.diagnose import from_metrics, quantile


def summary(
    queue: float, prefill: float, tpot: float, tokens: int = 9, interference: float = 0.0
) -> dict:
    decode = tpot * (tokens - 1)
    return {
        "queue_time": queue,
        "prefill_time": prefill,
        "ttft": queue + prefill,
        "decode_time": decode,
        "tpot": tpot,
        "itl": [tpot] * (tokens - 1),
        "e2e": queue + prefill + decode,
        "interference_time": interference,
        "interference_steps": 2 if interference else 0,
        "num_output_tokens": tokens,
    }


QUEUED = [summary(queue=2.0 + i / 10, prefill=0.1, tpot=0.02) for i in range(20)]
STUTTERING = [summary(queue=0.01, prefill=0.1, tpot=0.2, interference=1.2) for _ in range(20)]


def test_bench_file_names_the_dominant_phase(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"queued": QUEUED, "stuttering": STUTTERING}))
    result = CliRunner().invoke(app, ["diagnose", str(path), "--json"])
    assert result.exit_code == 0, result.output
    reports = json.loads(result.stdout)
    assert (
        reports["queued"]["dominant"] == "queue" and reports["queued"]["ttft"]["cause"] == "queue"
    )
    assert reports["stuttering"]["tpot"]["cause"] == "interference"


def test_metrics_text_gives_the_same_verdict():
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, "m")
    for s in QUEUED:
        metrics.observe_finished(s, 100, "length")
    report = from_metrics(generate_latest(registry).decode())
    assert report["dominant"] == "queue" and report["ttft"]["cause"] == "queue"
    assert 2.1 <= report["ttft"]["p50"] <= 5.0  # true median 3.05; bucket estimate


def test_quantile_interpolates_within_buckets():
    assert quantile([(1.0, 0), (2.0, 10), (float("inf"), 10)], 0.5) == 1.5
    assert quantile([], 0.5) is None


def test_bad_sources_get_a_message_not_a_traceback(tmp_path):
    runner = CliRunner()
    missing = runner.invoke(app, ["diagnose", str(tmp_path / "nope.json")])
    assert missing.exit_code == 1 and "no such file" in missing.stderr
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": 1}')
    result = runner.invoke(app, ["diagnose", str(bad)])
    assert (
        result.exit_code == 1
        and "cannot diagnose" in result.stderr
        and "Traceback" not in result.output
    )
