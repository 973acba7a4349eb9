"""In-process jobs run on a bounded pool; jobs a dead process held are marked failed at start."""

import subprocess
import sys
import threading
import time

from ingest import jobs
from provenance.db import session_scope
from provenance.models import IngestionJob
from provenance.settings import Settings


def settings_for(tmp_path, **extra) -> Settings:
    return Settings(data_dir=tmp_path / "data", database_url="", redis_url="", **extra)


def test_in_process_jobs_run_at_most_ingest_workers_at_a_time(tmp_path, monkeypatch):
    settings = settings_for(tmp_path, ingest_workers=2)
    running, peak, lock = set(), [0], threading.Lock()
    release = threading.Event()

    def fake_run(runtime, job_id):
        with lock:
            running.add(job_id)
            peak[0] = max(peak[0], len(running))
        release.wait(10)
        with lock:
            running.discard(job_id)
        jobs._update_job(runtime.settings, job_id, state="succeeded")

    monkeypatch.setattr(jobs, "run_ingestion_job", fake_run)
    ids = [jobs.submit_ingestion(jobs.Runtime(settings), "acme", [tmp_path]) for _ in range(5)]
    deadline = time.monotonic() + 10
    while len(running) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # room for a third thread to start, were the pool unbounded
    assert len(running) == 2
    states = [jobs.get_job(settings, i).state for i in ids]
    assert states.count("queued") == 5  # the fake never marks them running
    assert all(jobs.get_job(settings, i).summary["runner"] == jobs.runner() for i in ids)
    release.set()
    for job_id in ids:
        assert jobs.wait_for_job(settings, job_id, timeout_s=10).state == "succeeded"
    assert peak[0] == 2


def dead_runner() -> dict:
    """The runner record of a process that has exited (its pid no longer names it)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    start = jobs._process_start(child.pid)
    child.wait()
    return {**jobs.runner(), "pid": child.pid, "start": start}


def test_jobs_left_by_a_dead_process_are_marked_failed_with_the_reason(tmp_path):
    settings = settings_for(tmp_path)
    url = jobs._url(settings)
    dead = dead_runner()
    rows = {
        "running-dead": ("running", {"runner": dead}),
        "queued-dead": ("queued", {"runner": dead}),
        "running-alive": ("running", {"runner": jobs.runner()}),
        "running-elsewhere": ("running", {"runner": {**dead, "host": "another-host"}}),
        "queued-on-broker": ("queued", {}),  # a Celery job: the broker holds it
        "done": ("succeeded", {"runner": dead}),
    }
    with session_scope(url) as session:
        from provenance.truth import ensure_tenant

        ensure_tenant(session, "acme")
        for job_id, (state, summary) in rows.items():
            session.add(
                IngestionJob(id=job_id, tenant_id="acme", state=state, request={}, summary=summary)
            )

    assert sorted(jobs.fail_orphaned_jobs(settings)) == ["queued-dead", "running-dead"]
    failed = jobs.get_job(settings, "running-dead")
    assert failed.state == "failed"
    assert f"pid {dead['pid']}" in failed.summary["error"]
    assert "exited while it was running" in failed.summary["error"]
    assert "while it was queued" in jobs.get_job(settings, "queued-dead").summary["error"]
    for job_id in ("running-alive", "running-elsewhere", "queued-on-broker", "done"):
        assert jobs.get_job(settings, job_id).state == rows[job_id][0], job_id
    assert jobs.fail_orphaned_jobs(settings) == []  # idempotent
