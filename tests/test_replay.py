"""Replay: the receipt's pinned context, model and seed, run again, with a drift report.

The server runs in batch-invariant mode, so replay may claim bit-identical answers; one test
runs the default mode, where equal tokens carry no such claim.
"""

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import pytest
from api_support import serve_api
from engine_fixtures import needs_kernels
from sqlalchemy import update

from gateway.replay import verdict
from provenance.db import session_scope
from provenance.models import Chunk

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    needs_kernels()
    # Fifty requests of one tenant at once: above the default quota of requests in flight; the
    # server's default KV cache (32768 tokens) holds all fifty.
    yield from serve_api(tmp_path_factory, batch_invariant=True, tenant_max_concurrent_requests=64,
                         kv_cache_tokens=32768)

QUESTIONS = [
    "How long does a password reset link stay valid?",
    "How much does the Plus plan cost?",
    "Why does my file not sync?",
    "How do I share a file with a link?",
    "How do I turn on SMS codes?",
]


def replay(api, receipt_id, tenant="acme"):
    response = api.client.post(f"/v1/receipts/{receipt_id}/replay", headers=api.auth(tenant))
    assert response.status_code == 200, response.text
    return response.json()


def test_fifty_concurrent_greedy_answers_replay_identically(api):
    prompts = [f"{QUESTIONS[i % len(QUESTIONS)]} (case {i})" for i in range(50)]
    with ThreadPoolExecutor(max_workers=50) as pool:
        replies = list(pool.map(lambda q: api.chat(q, max_tokens=16), prompts))
    receipt_ids = [r["receipt_id"] for r in replies]
    assert len(set(receipt_ids)) == 50
    # Replayed concurrently too: each replay shares its batch with others, which the
    # batch-invariant engine promises cannot change a bit.
    with ThreadPoolExecutor(max_workers=16) as pool:
        verdicts = list(pool.map(lambda rid: replay(api, rid), receipt_ids))
    assert all(v["context_verified"] for v in verdicts)
    diverged = [
        (v["receipt_id"], v["first_divergent_token"])
        for v in verdicts
        if v["verdict"] != "identical"
    ]
    assert diverged == [], f"{len(diverged)} of 50 replays diverged: {diverged}"
    assert all(v["bitwise_claim"] for v in verdicts)
    assert all(v["replayed_output_hash"] == v["original_output_hash"] for v in verdicts)


def test_seeded_sampling_replays_identically(api):
    reply = api.chat(
        "How do I share a file with a link?", temperature=0.9, top_p=0.9, seed=1234, max_tokens=16
    )
    result = replay(api, reply["receipt_id"])
    assert result["verdict"] == "identical"


def test_logprobs_penalties_and_min_tokens_replay_identically(api):
    # Every field that changes the answer is in the receipt; replay rebuilds the same settings
    # and the batch-invariant engine gives the same bits.
    reply = api.chat(
        "How do I share a file with a link?", temperature=0.8, seed=77, max_tokens=20,
        min_tokens=12, logprobs=True, top_logprobs=2, presence_penalty=0.6,
        frequency_penalty=0.4, repetition_penalty=1.2, logit_bias={"13": -5},
    )
    assert reply["usage"]["completion_tokens"] >= 12
    assert len(reply["choices"][0]["logprobs"]["content"]) == reply["usage"]["completion_tokens"]
    result = replay(api, reply["receipt_id"])
    assert result["verdict"] == "identical" and result["bitwise_claim"]
    assert result["replayed_output"] == reply["choices"][0]["message"]["content"]


def test_bitwise_claim_needs_the_same_numerics(api, monkeypatch):
    reply = api.chat("How do I turn on SMS codes?", max_tokens=8)
    services = api.client.app.state.services
    numerics = {**services.engine_numerics, "max_num_batched_tokens": 512}
    monkeypatch.setattr(services, "engine_numerics", numerics)
    result = replay(api, reply["receipt_id"])
    assert result["verdict"] == "tokens_match" and not result["bitwise_claim"]
    assert any("max_num_batched_tokens" in p for p in result["problems"])


def test_drift_report_names_changed_and_deprecated_sources(api, tmp_path, monkeypatch):
    # Cite every source, not only the close ones, so one can be changed and another deprecated.
    monkeypatch.setattr(api.settings, "retrieval_min_score", -1.0)
    plans_reply = api.chat("How much does the Plus plan cost?")
    cited = {c["source_id"] for c in plans_reply["citations"]}
    assert "storage-plans.md" in cited
    changed = tmp_path / "corpus"
    changed.mkdir()
    text = (
        (api.corpus / "storage-plans.md")
        .read_text()
        .replace("costs 4 euros per month", "costs 5 euros per month")
    )
    (changed / "storage-plans.md").write_text(text)
    api.ingest("acme", changed / "storage-plans.md")
    deprecated = sorted(cited - {"storage-plans.md"})[0]
    assert (
        api.client.post(f"/admin/sources/{deprecated}/deprecate", headers=api.auth()).status_code
        == 200
    )
    result = replay(api, plans_reply["receipt_id"])
    assert result["verdict"] == "identical" and result["context_verified"]
    drift = result["drift"]
    assert drift["current_epoch"] > drift["snapshot_epoch"]
    status = {s["source_id"]: s for s in drift["sources"]}
    assert status["storage-plans.md"]["status"] == "changed"
    plans = status["storage-plans.md"]
    diff = plans["chunk_diffs"][0]["diff"].splitlines()
    assert diff[:2] == [f"--- storage-plans.md@v{plans['cited_version']}",
                        f"+++ storage-plans.md@v{plans['latest_version']}"]
    removed = [line for line in diff[2:] if line.startswith("-")]
    added = [line for line in diff[2:] if line.startswith("+")]
    assert len(removed) == len(added) == 1  # the one line that changed, and only it
    assert "costs 4 euros per month" in removed[0] and "costs 5 euros per month" in added[0]
    assert status[deprecated]["status"] == "deprecated"


def test_tampered_chunk_is_not_claimed(api):
    reply = api.chat("How do I reset my password?")
    chunk_id = reply["citations"][0]["chunk_id"]
    with session_scope(api.settings.sqlalchemy_url, write=True) as session:
        original = session.get(Chunk, chunk_id).text
        session.execute(
            update(Chunk)
            .where(Chunk.id == chunk_id)
            .values(text=original + " Links now last 30 days.")
        )
    try:
        result = replay(api, reply["receipt_id"])
    finally:
        with session_scope(api.settings.sqlalchemy_url, write=True) as session:
            session.execute(update(Chunk).where(Chunk.id == chunk_id).values(text=original))
    assert result["context_verified"] is False and result["verdict"] is None
    assert any(chunk_id in p for p in result["problems"])


def test_replay_refuses_different_weights_and_hides_foreign_receipts(api, monkeypatch):
    reply = api.chat("How do I reset my password?")
    services = api.client.app.state.services
    monkeypatch.setattr(services, "weights_hash", "0" * 64)
    response = api.client.post(f"/v1/receipts/{reply['receipt_id']}/replay", headers=api.auth())
    monkeypatch.undo()
    error = response.json()["error"]
    assert (
        response.status_code == 409
        and "0" * 64 in error["message"]
        and services.weights_hash in error["message"]
    )
    assert (
        api.client.post("/v1/receipts/rcpt_unknown/replay", headers=api.auth()).status_code == 404
    )
    assert (
        api.client.post(
            f"/v1/receipts/{reply['receipt_id']}/replay", headers=api.auth("acme", "chat")
        ).status_code
        == 403
    )


def test_verdict_names_the_first_divergent_token_and_the_agreement():
    assert verdict([5, 6, 7, 8], [5, 6, 9, 8], bitwise=True) == ("diverged", 2, 0.75)
    assert verdict([5, 6, 7, 8], [5, 6], bitwise=False) == ("diverged", 2, 0.5)  # stopped early
    assert verdict([5, 6], [5, 6, 7, 8], bitwise=False) == ("diverged", 2, 0.5)
    assert verdict([5, 6], [5, 6], bitwise=True) == ("identical", None, 1.0)
    assert verdict([5, 6], [5, 6], bitwise=False) == ("tokens_match", None, 1.0)


def test_a_replay_that_differs_is_diverged_at_its_first_differing_token(api, monkeypatch):
    """The engine gives another token at position 5 (as a near-tie flipped by other numerics
    would): the verdict says diverged, where, and how much still agrees."""
    reply = api.chat("Why does my file not sync?", max_tokens=12)
    engine = api.client.app.state.services.engine
    real = engine.generate

    async def other_token_at_5(*args, **kwargs):
        position = 0
        async for out in real(*args, **kwargs):
            ids = [t + 1 if position + i == 5 else t for i, t in enumerate(out.token_ids)]
            position += len(ids)
            yield dataclasses.replace(out, token_ids=ids)

    monkeypatch.setattr(engine, "generate", other_token_at_5)
    result = replay(api, reply["receipt_id"])
    assert reply["usage"]["completion_tokens"] > 5
    assert result["context_verified"] and result["verdict"] == "diverged"
    assert result["first_divergent_token"] == 5
    assert result["token_agreement"] == pytest.approx(
        (reply["usage"]["completion_tokens"] - 1) / reply["usage"]["completion_tokens"])


def test_drift_report_names_deleted_and_unchanged_sources(api, monkeypatch):
    # Tenant globex gets its own copy of the corpus, so deleting a source leaves acme's alone.
    monkeypatch.setattr(api.settings, "retrieval_min_score", -1.0)
    api.ingest("globex", api.corpus)
    reply = api.chat("How much does the Plus plan cost?", tenant="globex")
    cited = sorted({c["source_id"] for c in reply["citations"]})
    assert len(cited) >= 2
    before = replay(api, reply["receipt_id"], "globex")
    assert before["drift"]["retrieval_unchanged"] is True
    assert {s["source_id"]: s["status"] for s in before["drift"]["sources"]} == dict.fromkeys(
        cited, "unchanged")

    deleted = next(c for c in cited if c != "storage-plans.md")
    response = api.client.delete(f"/admin/sources/{deleted}", headers=api.auth("globex"))
    assert response.status_code == 200, response.text
    after = replay(api, reply["receipt_id"], "globex")
    # The receipt's own chunks stay readable: the replay is still verified and identical.
    assert after["context_verified"] and after["verdict"] == "identical"
    drift = after["drift"]
    assert {s["source_id"]: s["status"] for s in drift["sources"]} == {
        c: "deleted" if c == deleted else "unchanged" for c in cited}
    assert drift["retrieval_unchanged"] is False
    assert deleted not in {c["source_id"] for c in drift["retrieved_now"]}


def test_a_request_without_retrieval_replays_with_no_retrieval_drift(api):
    reply = api.chat("How much does the Plus plan cost?", inherent={"retrieval": False})
    assert reply["citations"] == []
    result = replay(api, reply["receipt_id"])
    assert result["context_verified"] and result["problems"] == []
    assert result["verdict"] == "identical" and result["bitwise_claim"]
    assert result["replayed_output_hash"] == result["original_output_hash"]
    assert result["drift"] == {"retrieval_enabled": False}
