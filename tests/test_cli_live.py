"""The console script run for real, each command a subprocess on one temporary data dir: `db`,
`ingest`, `jobs`, `keys`, `serve`, then `ask`, `replay` and `diagnose` against the live server.

The server runs the tiny random Llama (these tests are about the commands, not the model) in
batch-invariant mode, so replay may claim identical bits.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path

import httpx
import pytest
from engine_fixtures import needs_kernels, write_tiny_llama
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
INHERENT = Path(sys.executable).parent / "inherent"
# The installed console script, run by this interpreter (its shebang may name another path to
# the same environment, and the C++ kernels' build is keyed by the interpreter's paths).
COMMAND = [sys.executable, str(INHERENT)]


class Cli:
    def __init__(self, env: dict[str, str], corpus: Path):
        self.env, self.corpus = env, corpus

    def __call__(self, *args: str, ok: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        result = subprocess.run([*COMMAND, *args], env=self.env, cwd=REPO, text=True,
                                capture_output=True, timeout=timeout)
        if ok:
            assert result.returncode == 0, f"inherent {' '.join(args)}:\n{result.stdout}\n{result.stderr}"
        return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cli(tmp_path_factory) -> Cli:
    needs_kernels()  # the server runs in batch-invariant mode
    if not INHERENT.exists():
        pytest.skip(f"no console script at {INHERENT}: install the project (pip install -e .)")
    root = tmp_path_factory.mktemp("cli")
    corpus = root / "corpus"
    shutil.copytree(Path(str(resources.files("gateway") / "demo_corpus")), corpus)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "INHERENT_DATA_DIR": str(root / "data"),
        "INHERENT_MODEL_PATH": str(write_tiny_llama(root / "tiny-llama",
                                                    max_position_embeddings=4096)),
        "INHERENT_BATCH_INVARIANT": "true",
        "INHERENT_KV_CACHE_TOKENS": "4096",
        "COLUMNS": "200",
    }
    for name in ("INHERENT_DATABASE_URL", "INHERENT_QDRANT_URL", "INHERENT_REDIS_URL"):
        env.pop(name, None)  # the embedded default
    return Cli(env, corpus)


@pytest.fixture(scope="module")
def ingested(cli) -> str:
    """`db upgrade`, then `ingest` of the demo corpus for tenant acme; the job id."""
    upgraded = cli("db", "upgrade")
    head = re.search(r"database at revision (\S+)", upgraded.stdout).group(1)
    assert cli("db", "current").stdout.split() == ["current:", head, "head:", head]
    result = cli("ingest", str(cli.corpus), "--tenant", "acme")
    job = re.search(r"job (\S+): succeeded (\{.*\})", result.stdout)
    assert job, result.stdout
    assert json.loads(job.group(2))["added"] == len(list(cli.corpus.iterdir()))
    return job.group(1)


@pytest.fixture(scope="module")
def server(cli, ingested):
    """`inherent serve` on a free port (after ingestion: the embedded index has one owner)."""
    secret = cli("keys", "create", "--tenant", "acme", "--scope", "chat", "--scope",
                 "audit").stdout.strip().splitlines()[-1]
    port = free_port()
    log_path = Path(cli.env["INHERENT_DATA_DIR"]) / "serve.log"
    with log_path.open("w") as log:
        process = subprocess.Popen([*COMMAND, "serve", "--port", str(port)], env=cli.env,
                                   cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900  # a cap for loaded machines; seconds on an idle one
    try:
        while True:
            if process.poll() is not None:
                pytest.fail(f"inherent serve exited {process.returncode}:\n"
                            f"{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/readyz", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("inherent serve did not become ready in 900 s")
            time.sleep(0.2)
        yield url, secret
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            assert process.wait(300) == 0, log_path.read_text()[-3000:]  # a clean shutdown
        finally:
            if process.poll() is None:
                process.kill()


def test_jobs_lists_and_shows_the_ingestion(cli, ingested):
    listed = cli("jobs", "--tenant", "acme").stdout
    assert ingested in listed and "succeeded" in listed and "5/5" in listed
    shown = cli("jobs", ingested).stdout
    assert f"job {ingested}: succeeded" in shown and "sources 5/5" in shown
    missing = cli("jobs", "nope", ok=False)
    assert missing.returncode == 1 and "no job nope" in missing.stderr


def test_ask_replay_and_diagnose_against_the_live_server(cli, server):
    url, key = server
    asked = cli("ask", "How long does a password reset link stay valid?", "--url", url,
                "--key", key, "--max-tokens", "12").stdout
    receipt_id = re.search(r"receipt (rcpt_\w+)", asked).group(1)
    assert "(reset-password.md v1)" in asked  # the citation line
    replayed = cli("replay", receipt_id, "--url", url, "--key", key).stdout
    assert f"receipt {receipt_id}: context verified" in replayed
    assert "verdict: identical" in replayed and "token agreement 100%" in replayed
    assert "retrieval unchanged" in replayed and "reset-password.md v1: unchanged" in replayed
    refused = cli("ask", "hi", "--url", url, "--key", "ink_wrong", ok=False)
    assert refused.returncode == 1 and "401" in refused.stderr

    # The report the command prints is the server's own histograms: the answer and its replay.
    # /metrics is not open: the command sends an audit key (or the operator's metrics token).
    closed = cli("diagnose", url + "/metrics", ok=False)
    assert closed.returncode == 1 and "401" in closed.stderr
    metrics = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {key}"}).text
    report = json.loads(cli("diagnose", url + "/metrics", "--json", "--token", key).stdout)[
        url + "/metrics"
    ]
    sums = {s.name: s.value for family in text_string_to_metric_families(metrics)
            for s in family.samples if s.name.startswith("inherent:request_")}
    assert report["totals"]["prefill"] == pytest.approx(
        sums["inherent:request_prefill_time_seconds_sum"])
    assert report["totals"]["prefill"] > 0 and report["ttft"]["p50"] > 0
    assert report["dominant"] in report["share"]
    assert report["verdict"].startswith("TTFT p50")
    unreachable = cli("diagnose", f"http://127.0.0.1:{free_port()}/metrics", ok=False)
    assert unreachable.returncode == 1 and "cannot diagnose" in unreachable.stderr


def test_db_downgrade_to_base_and_back(cli):
    other = Cli({**cli.env, "INHERENT_DATA_DIR": cli.env["INHERENT_DATA_DIR"] + "-db"}, cli.corpus)
    head = re.search(r"revision (\S+)", other("db", "upgrade").stdout).group(1)
    assert "database at revision base" in other("db", "downgrade", "base").stdout
    assert other("db", "current").stdout.split() == ["current:", "base", "head:", head]
