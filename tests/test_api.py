"""The chat API through the official openai client, receipts, auth, tenancy and bad input."""

import gc
import json
import threading
import time

import pytest
from api_support import api  # noqa: F401  (fixture)
from blake3 import blake3
from fastapi.testclient import TestClient
from openai import OpenAI
from rfc6962 import h_leaf, root_from_path, roots_from_consistency

from engine.cpu_kernels import Bf16Linear
from engine.model import _BlockLinear, native_bf16
from gateway.app import create_app
from gateway.settings import ServerSettings
from provenance.db import session_scope
from provenance.hashing import canonical_json
from provenance.migrate import ensure_schema
from provenance.models import AuditLeaf, Receipt

pytestmark = pytest.mark.slow


def openai_client(api, tenant="acme") -> OpenAI:
    return OpenAI(
        base_url="http://testserver/v1",
        api_key=api.key(tenant),
        http_client=api.client,
        max_retries=0,
    )


def test_openai_client_non_streaming_gets_answer_citations_and_receipt(api):
    client = openai_client(api)
    start = time.perf_counter()
    raw = client.chat.completions.with_raw_response.create(
        model="inherent",
        messages=[{"role": "user", "content": "How long does a password reset link stay valid?"}],
        temperature=0,
        max_tokens=32,
    )
    wall = time.perf_counter() - start
    completion = raw.parse()
    assert completion.choices[0].message.content.strip()
    assert completion.usage.completion_tokens > 0
    extra = completion.model_extra
    assert extra["receipt_id"] == raw.headers["X-Receipt-Id"]
    assert extra["citations"][0]["source_id"] == "reset-password.md"
    receipt = api.client.get(f"/v1/receipts/{extra['receipt_id']}", headers=api.auth()).json()
    body = receipt["body"]
    assert body["gen_ai.usage.output_tokens"] == completion.usage.completion_tokens
    assert body["inherent.output.text"] == completion.choices[0].message.content
    assert body["gen_ai.request.temperature"] == 0 and body["gen_ai.response.finish_reasons"]
    assert [c["chunk_id"] for c in body["inherent.retrieval.chunks"]] == [
        c["chunk_id"] for c in extra["citations"]
    ]
    # The engine's phases of this request: waiting plus prefill is its TTFT, all of it within
    # the request's wall time here.
    timeline = body["inherent.timeline"]
    assert timeline["ttft"] == pytest.approx(timeline["queue_time"] + timeline["prefill_time"])
    assert timeline["prefill_time"] > 0 and timeline["e2e"] <= wall
    assert timeline["num_output_tokens"] == completion.usage.completion_tokens
    assert receipt["inclusion_proof"]["tree_size"] >= 1


def test_openai_client_streaming_ends_with_receipt_and_usage(api):
    client = openai_client(api)
    stream = client.chat.completions.create(
        model="inherent",
        messages=[{"role": "user", "content": "How much does the Plus plan cost?"}],
        temperature=0,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text.strip() and len(finals) == 1
    receipt_id = finals[0].model_extra["receipt_id"]
    assert (
        chunks[-1].usage.completion_tokens > 0
        and chunks[-1].model_extra["receipt_id"] == receipt_id
    )
    body = api.client.get(f"/v1/receipts/{receipt_id}", headers=api.auth()).json()["body"]
    assert body["inherent.output.text"] == text and body["status"] == "ok"


def test_models_lists_the_served_model(api):
    models = openai_client(api).models.list()
    services = api.client.app.state.services
    assert [m.id for m in models.data] == [services.model_id, services.embedding_model_name]


def error_of(response) -> dict:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_bad_input_gets_openai_style_4xx(api):
    post = api.client.post
    ok = {"model": "inherent", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    response = post(
        "/v1/chat/completions",
        content=b"{not json",
        headers={**api.auth(), "Content-Type": "application/json"},
    )
    assert response.status_code == 400 and "JSON" in error_of(response)["message"]
    response = post("/v1/chat/completions", json={**ok, "model": "gpt-9"}, headers=api.auth())
    assert response.status_code == 404 and error_of(response)["code"] == "model_not_found"
    response = post("/v1/chat/completions", json={**ok, "messages": []}, headers=api.auth())
    assert response.status_code == 400 and error_of(response)["param"] == "messages"
    response = post("/v1/chat/completions", json={**ok, "temperature": -1}, headers=api.auth())
    assert response.status_code == 400 and error_of(response)["param"] == "temperature"
    huge = {**ok, "messages": [{"role": "user", "content": "word " * 9000}]}
    response = post("/v1/chat/completions", json=huge, headers=api.auth())
    assert response.status_code == 400 and error_of(response)["code"] == "context_length_exceeded"
    response = post(
        "/v1/chat/completions", json={**ok, "inherent": {"snapshot": 10**9}}, headers=api.auth()
    )
    assert response.status_code == 400 and error_of(response)["code"] == "unknown_snapshot"
    response = post("/v1/chat/completions", json=ok)
    assert response.status_code == 401 and error_of(response)["type"] == "authentication_error"
    response = post("/v1/chat/completions", json=ok, headers={"Authorization": "Bearer ink_wrong"})
    assert response.status_code == 401
    response = post("/v1/chat/completions", json=ok, headers=api.auth("acme", "audit"))
    assert response.status_code == 403 and error_of(response)["type"] == "permission_error"


def test_scopes_guard_every_route(api):
    chat_only = api.auth("acme", "chat")
    for method, path in [
        ("GET", "/v1/receipts"),
        ("GET", "/v1/audit/root"),
        ("GET", "/admin/sources"),
        ("GET", "/admin/jobs"),
    ]:
        assert api.client.request(method, path, headers=chat_only).status_code == 403, path
    assert api.client.get("/admin/sources", headers=api.auth("acme", "admin")).status_code == 200


def test_tenants_see_only_their_own_receipts_and_sources(api):
    receipt_id = api.chat("How do I share a file?")["receipt_id"]
    other = api.auth("globex")
    response = api.client.get(f"/v1/receipts/{receipt_id}", headers=other)
    unknown = api.client.get("/v1/receipts/rcpt_doesnotexist", headers=other)
    assert response.status_code == unknown.status_code == 404
    assert response.json() == {
        "error": {**unknown.json()["error"], "message": response.json()["error"]["message"]}
    }
    assert api.client.post(f"/v1/receipts/{receipt_id}/replay", headers=other).status_code == 404
    assert api.client.get("/admin/sources", headers=other).json()["data"] == []
    assert api.client.get("/v1/receipts", headers=other).json()["data"] == []
    # globex retrieves nothing from acme's corpus
    assert api.chat("How do I share a file?", tenant="globex")["citations"] == []


def test_pinned_snapshot_gives_byte_identical_prompt_after_new_ingestion(api, tmp_path):
    question = "Can I protect a shared link with a password?"
    first = api.chat(question)
    snapshot = api.client.get(f"/v1/receipts/{first['receipt_id']}", headers=api.auth()).json()[
        "body"
    ]["inherent.retrieval.snapshot_epoch"]
    extra = tmp_path / "links-faq.md"
    extra.write_text(
        "# Link passwords\n\nYes: on Plus and Business plans a shared link can have a password and an expiry date.\n"
    )
    api.ingest("acme", extra)
    pinned = api.chat(question, inherent={"snapshot": snapshot})
    current = api.chat(question)

    def prompt_hash(reply):
        return api.client.get(f"/v1/receipts/{reply['receipt_id']}", headers=api.auth()).json()[
            "body"
        ]["inherent.prompt.hash"]

    assert prompt_hash(pinned) == prompt_hash(first)
    assert pinned["citations"] == first["citations"]
    assert "links-faq.md" in [c["source_id"] for c in current["citations"]]
    assert prompt_hash(current) != prompt_hash(first)


def test_failure_mid_stream_leaves_a_failed_receipt(api, monkeypatch):
    engine = api.client.app.state.services.engine
    real = engine.generate

    async def dies_after_first(*args, **kwargs):
        async for out in real(*args, **kwargs):
            yield out
            raise RuntimeError("worker lost")

    monkeypatch.setattr(engine, "generate", dies_after_first)
    body = {
        "model": "inherent",
        "messages": [{"role": "user", "content": "How do I reset my password?"}],
        "max_tokens": 16,
        "stream": True,
    }
    with api.client.stream(
        "POST", "/v1/chat/completions", json=body, headers=api.auth()
    ) as response:
        receipt_id = response.headers["X-Receipt-Id"]
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][6:])
    assert error["error"]["code"] == "generation_failed" and error["receipt_id"] == receipt_id
    assert "worker lost" not in error["error"]["message"]  # exception text stays in the log
    receipt = api.client.get(f"/v1/receipts/{receipt_id}", headers=api.auth()).json()
    assert receipt["status"] == "failed"
    assert receipt["body"]["error.type"] == "generation_failed"


def test_query_embeddings_run_on_the_engine_thread(api, monkeypatch):
    """A request's query and a replay's drift check embed on the engine thread between steps,
    never beside it on a thread of their own (engine/async_engine.py: two OpenMP teams)."""
    embedder = api.app.state.services.embedder
    model = embedder.model
    threads = []

    def recording(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return model(*args, **kwargs)

    monkeypatch.setattr(embedder, "model", recording)
    reply = api.chat("How do I reset my password?", max_tokens=4)
    assert reply["citations"]  # retrieval ran
    response = api.client.post(f"/v1/receipts/{reply['receipt_id']}/replay", headers=api.auth())
    assert response.status_code == 200, response.text
    assert threads == ["inherent-engine"] * 2


def test_a_tenant_with_nothing_ingested_is_answered_without_embedding_its_query(api, monkeypatch):
    """Its snapshot is epoch 0, so there is nothing to search: once the engine thread knows it
    (here it comes to the call after the snapshot resolved, as a busy engine does), the
    embedding's forward is skipped, and the receipt records the empty retrieval a search gives."""
    services = api.app.state.services
    embedder, engine = services.embedder, services.engine
    forwards = []
    model = embedder.model
    monkeypatch.setattr(embedder, "model", lambda *a, **k: forwards.append(1) or model(*a, **k))
    run_between_steps = engine.run_between_steps

    def at_the_next_step(fn, meanwhile=None):
        if meanwhile is not None:
            meanwhile()
        return run_between_steps(fn)

    monkeypatch.setattr(engine, "run_between_steps", at_the_next_step)
    reply = api.chat("How do I reset my password?", tenant="newcomer", max_tokens=4)
    assert forwards == [] and reply["citations"] == []
    receipt = api.client.get(f"/v1/receipts/{reply['receipt_id']}",
                             headers=api.auth("newcomer")).json()["body"]
    assert receipt["inherent.retrieval.enabled"] and receipt["inherent.retrieval.snapshot_epoch"] == 0
    assert receipt["inherent.retrieval.chunks"] == []
    # a tenant with a knowledge base still has its query embedded, at the same engine timing
    assert api.chat("How do I reset my password?", max_tokens=4)["citations"] and forwards


def test_metrics_and_health(api):
    assert api.client.get("/healthz").json() == {"status": "ok"}
    assert api.client.get("/readyz").status_code == 200
    api.chat("How do I reset my password?")
    text = api.client.get("/metrics", headers=api.auth("acme", "audit")).text
    for name in (
        "inherent:time_to_first_token_seconds_count",
        "inherent:http_requests_total",
        "inherent:generation_tokens_total",
    ):
        assert name in text, name

    def chats_answered() -> float:  # by route template and status
        text = api.client.get("/metrics", headers=api.auth("acme", "audit")).text
        series = ('inherent:http_requests_total{method="POST",route="/v1/chat/completions",'
                  'status="200"} ')
        return float(next(line for line in text.splitlines()
                          if line.startswith(series)).removeprefix(series))

    before = chats_answered()
    api.client.post("/v1/chat/completions", headers=api.auth(),
                    json={"model": "inherent", "stream": True, "max_tokens": 2,
                          "messages": [{"role": "user", "content": "How do I reset my password?"}]})
    assert chats_answered() == before + 1  # a streamed answer counts too


def test_default_mode_replay_claims_bit_identical_answers(api):
    """Batch-invariant mode is on by default wherever it runs (CPU, float32, the kernels): a
    receipt records it, and its replay, in other batch shapes, claims and gets the same bits.
    (What a receipt without the mode gets: tests/test_replay.py.)"""
    reply = api.chat("How much does the Plus plan cost?", max_tokens=8)
    receipt = api.client.get(f"/v1/receipts/{reply['receipt_id']}", headers=api.auth()).json()
    assert receipt["body"]["inherent.engine"]["batch_invariant"] is True
    response = api.client.post(f"/v1/receipts/{reply['receipt_id']}/replay", headers=api.auth())
    result = response.json()
    assert result["bitwise_claim"] and result["context_verified"]
    assert (result["verdict"], result["token_agreement"]) == ("identical", 1.0)


def test_audit_root_and_consistency_bodies_and_a_receipts_inclusion_proof_verify(api):
    """The tenant's published root, a consistency proof from an earlier root, and a new
    receipt's inclusion proof, all checked with the suite's own RFC 6962 verifier
    (tests/rfc6962.py); the leaf is rebuilt from the receipt row (and the leaf's random nonce),
    so the proof commits to this receipt."""
    before = api.client.get("/v1/audit/root", headers=api.auth()).json()
    reply = api.chat("Why does my file not sync?", max_tokens=8)
    after = api.client.get("/v1/audit/root", headers=api.auth()).json()
    receipt = api.client.get(f"/v1/receipts/{reply['receipt_id']}", headers=api.auth()).json()
    assert set(after) == {"tree_size", "root", "hash", "leaf_prefix", "node_prefix"}
    assert (after["hash"], after["leaf_prefix"], after["node_prefix"]) == ("blake3", "00", "01")
    assert after["tree_size"] == before["tree_size"] + 1  # this answer's receipt, nothing else

    proof = receipt["inclusion_proof"]
    assert (proof["tree_size"], proof["root"]) == (after["tree_size"], after["root"])
    assert proof["leaf_index"] == after["tree_size"] - 1
    with session_scope(api.settings.sqlalchemy_url) as session:
        row = session.get(Receipt, reply["receipt_id"])
        nonce = session.get(AuditLeaf, ("acme", proof["leaf_index"])).nonce
        leaf = {"kind": "receipt", "ref": row.id, "nonce": nonce, "payload": {
            "receipt_id": row.id, "tenant_id": "acme", "api_key_id": row.api_key_id,
            "status": receipt["status"], "snapshot_epoch": row.snapshot_epoch,
            "model_id": row.model_id, "weights_hash": row.weights_hash,
            "prompt_hash": receipt["body"]["inherent.prompt.hash"],
            "output_hash": receipt["body"]["inherent.output.hash"],
            "body_hash": blake3(canonical_json(receipt["body"])).hexdigest()}}
    leaf_hash = h_leaf(canonical_json(leaf))
    assert proof["leaf_hash"] == leaf_hash.hex()
    path = [bytes.fromhex(h) for h in proof["audit_path"]]
    rebuilt = root_from_path(proof["leaf_index"], leaf_hash, path, proof["tree_size"])
    assert rebuilt.hex() == after["root"]

    response = api.client.get(
        "/v1/audit/consistency",
        params={"from": before["tree_size"], "to": after["tree_size"]},
        headers=api.auth(),
    )
    body = response.json()
    assert set(body) == {"first", "second", "first_root", "second_root", "consistency"}
    assert (body["first"], body["second"]) == (before["tree_size"], after["tree_size"])
    assert (body["first_root"], body["second_root"]) == (before["root"], after["root"])
    old, new = roots_from_consistency(
        before["tree_size"], after["tree_size"],
        [bytes.fromhex(h) for h in body["consistency"]], bytes.fromhex(before["root"]))
    assert (old.hex(), new.hex()) == (before["root"], after["root"])
    beyond = api.client.get("/v1/audit/consistency", headers=api.auth(),
                            params={"from": 1, "to": after["tree_size"] + 1})
    assert beyond.status_code == 400 and error_of(beyond)["code"] == "invalid_range"


def test_receipts_since_lists_only_the_later_receipts(api):
    def created_at(reply):
        return api.client.get(f"/v1/receipts/{reply['receipt_id']}",
                              headers=api.auth()).json()["created_at"]

    first = api.chat("How do I share a file?", max_tokens=4)
    second = api.chat("How much does the Plus plan cost?", max_tokens=4)
    since = created_at(second)
    assert created_at(first) < since
    listed = api.client.get("/v1/receipts", params={"since": since}, headers=api.auth()).json()
    assert [r["id"] for r in listed["data"]] == [second["receipt_id"]]
    everything = api.client.get("/v1/receipts", params={"limit": 1000}, headers=api.auth())
    assert {first["receipt_id"], second["receipt_id"]} <= {r["id"] for r in everything.json()["data"]}
    bad = api.client.get("/v1/receipts", params={"since": "yesterday"}, headers=api.auth())
    assert bad.status_code == 400 and error_of(bad)["param"] == "since"


def test_receipt_records_the_dtypes_the_engine_runs(api):
    """The receipt's numerics are what the live model computes in, not what was asked for:
    bf16 matmuls and KV cache on a CPU with bf16 instructions, float32 elsewhere."""
    reply = api.chat("How do I reset my password?", max_tokens=4)
    body = api.client.get(f"/v1/receipts/{reply['receipt_id']}", headers=api.auth()).json()["body"]
    recorded = body["inherent.engine"]
    runner = api.client.app.state.services.engine.engine.model_runner
    model, kv = runner.model, runner.kv_cache[0]

    def ran_in(linear) -> str:
        # A GGUF-block matmul computes in float32 (activations and sums); with batch-invariant
        # mode off it hands larger batches to its dense matmul, whose dtype the receipt records.
        while isinstance(linear, _BlockLinear):
            if linear.dense is None:
                return "float32"
            linear = linear.dense
        return "bfloat16" if isinstance(linear, Bf16Linear) else dtype_name(linear.dtype)

    assert recorded["dtype"] == dtype_name(model.dtype) == "float32"
    assert recorded["kv_cache_dtype"] == dtype_name(kv.dtype)
    expected = "bfloat16" if native_bf16() else "float32"
    assert recorded["matmul_dtype"] == expected
    layer = model.layers[0]
    assert {ran_in(lin) for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)} == {expected}
    assert dtype_name(kv.dtype) == expected


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def test_a_running_gateway_keeps_what_startup_made_out_of_garbage_collections(tmp_path):
    """A full collection walks every object the collector tracks while all threads wait on it:
    what startup loaded stays out of its walk while the app runs, and is back when it stops."""

    class Loaded:
        tracer = None

        def __init__(self):
            self.model = [[layer] for layer in range(100)]  # startup's long-lived objects

        async def start(self): ...

        async def stop(self): ...

    def tracked(obj) -> bool:
        return any(o is obj for o in gc.get_objects())

    settings = ServerSettings(data_dir=tmp_path, database_url="", qdrant_url="", redis_url="")
    ensure_schema(settings.sqlalchemy_url)
    services = Loaded()
    assert tracked(services.model)
    with TestClient(create_app(settings, services_factory=lambda s, r: services)):
        assert not tracked(services.model)
        assert gc.get_freeze_count() > 0
    assert tracked(services.model)
    assert gc.get_freeze_count() == 0
