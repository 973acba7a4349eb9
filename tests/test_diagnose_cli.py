"""`inherent diagnose` traces "it's slow" to a phase, from a bench file or a metrics endpoint."""

import asyncio
import dataclasses
import json
import random

import pytest
from engine_fixtures import write_tiny_llama
from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from typer.testing import CliRunner

from engine import AsyncEngine, EngineConfig, SamplingParams
from engine.diagnosis import from_metrics, quantile
from engine.finish_reason import FinishReason
from engine.metrics import EngineMetrics
from engine.timeline import RequestTimeline, TimelineSummary
from gateway.cli import app


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


def observed(s: dict) -> TimelineSummary:
    """`s` as the engine hands it to EngineMetrics: a finished request of 100 prompt tokens."""
    empty = RequestTimeline(arrival=0.0).summary(None, FinishReason.LENGTH, 100)
    return dataclasses.replace(empty, **(s | {"itl": tuple(s["itl"])}))


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
        metrics.observe_finished(observed(s))
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


async def decodes_under_long_prefills(engine: AsyncEngine) -> None:
    """Two requests stream 48 tokens each; once both are decoding, four 1024-token prompts
    arrive and their prefill chunks fill the decoders' steps until every prompt is in."""
    rng = random.Random(0)
    decoding = asyncio.Event()
    started = set()

    async def run(name: str, prompt: list[int], max_tokens: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        async for _ in engine.generate(prompt, params, name):
            started.add(name)
            if {"decoder-0", "decoder-1"} <= started:
                decoding.set()

    async def long_prompts() -> None:
        await decoding.wait()
        await asyncio.gather(*(
            run(f"long-{i}", [rng.randrange(3, 300) for _ in range(1024)], 1) for i in range(4)
        ))

    await asyncio.gather(
        run("decoder-0", [5, 6, 7, 8], 48), run("decoder-1", [9, 10, 11, 12], 48), long_prompts()
    )


@pytest.mark.slow
def test_live_metrics_of_an_engine_under_prefill_interference_name_interference(tmp_path):
    """A real engine (a random Llama big enough that a prefill chunk costs many decode steps)
    serves decodes while long prompts arrive; `inherent diagnose` scrapes its /metrics over
    HTTP and blames the stutter on interference."""
    model = write_tiny_llama(tmp_path / "llama", hidden_size=256, intermediate_size=768,
                             max_position_embeddings=2048)
    registry = CollectorRegistry()
    engine = AsyncEngine.from_config(
        EngineConfig(model=str(model), num_kv_blocks=512, max_model_len=2048,
                     max_num_batched_tokens=512),
        registry,
    )
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        asyncio.run(decodes_under_long_prefills(engine))
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        result = CliRunner().invoke(app, ["diagnose", url, "--json"])
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)[url]
        assert report["tpot"]["cause"] == "interference", report
        assert report["totals"]["interference"] > report["totals"]["decode"] > 0
        tpot_line = report["verdict"].splitlines()[1]
        assert tpot_line.startswith("TPOT") and "mostly interference" in tpot_line
        printed = CliRunner().invoke(app, ["diagnose", url], env={"COLUMNS": "200"})
        assert printed.exit_code == 0 and "mostly interference" in printed.stdout
    finally:
        server.shutdown()
        thread.join()
        engine.shutdown()
