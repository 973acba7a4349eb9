"""The chat API through the official openai client, receipts, auth, tenancy and bad input."""

import json

import pytest
from api_support import api  # noqa: F401  (fixture)
from openai import OpenAI

from engine import EngineOverloaded

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
    raw = client.chat.completions.with_raw_response.create(
        model="inherent",
        messages=[{"role": "user", "content": "How long does a password reset link stay valid?"}],
        temperature=0,
        max_tokens=32,
    )
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
    assert body["inherent.timeline"]["ttft"] >= body["inherent.timeline"]["queue_time"] >= 0
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
    assert [m.id for m in models.data] == [api.client.app.state.services.model_id]


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


def test_overloaded_engine_answers_429_with_retry_after(api, monkeypatch):
    engine = api.client.app.state.services.engine

    async def overloaded(*args, **kwargs):
        raise EngineOverloaded("1 requests are already waiting")
        yield  # an async generator, like the real one

    monkeypatch.setattr(engine, "generate", overloaded)
    body = {"model": "inherent", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    response = api.client.post("/v1/chat/completions", json=body, headers=api.auth())
    assert response.status_code == 429 and response.headers["Retry-After"] == "1"
    assert error_of(response)["type"] == "rate_limit_error"


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
    assert "worker lost" in json.loads(events[-2][6:])["error"]["message"]
    receipt = api.client.get(f"/v1/receipts/{receipt_id}", headers=api.auth()).json()
    assert receipt["status"] == "failed" and receipt["body"]["error.type"] == "RuntimeError"


def test_metrics_and_health(api):
    assert api.client.get("/healthz").json() == {"status": "ok"}
    assert api.client.get("/readyz").status_code == 200
    api.chat("How do I reset my password?")
    text = api.client.get("/metrics").text
    for name in (
        "inherent:time_to_first_token_seconds_count",
        "inherent:http_requests_total",
        "inherent:generation_tokens_total",
    ):
        assert name in text, name


def test_default_mode_replay_reports_token_agreement_not_bits(api):
    reply = api.chat("How much does the Plus plan cost?", max_tokens=8)
    response = api.client.post(f"/v1/receipts/{reply['receipt_id']}/replay", headers=api.auth())
    result = response.json()
    assert result["verdict"] == "tokens_match" and result["token_agreement"] == 1.0
    assert not result["bitwise_claim"]
