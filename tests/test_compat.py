"""Compatibility with the clients users already run: the official openai client on every
endpoint (streaming and not), and the exact bodies guidellm and LangChain's ChatOpenAI send."""

import json

import numpy as np
import pytest
from api_support import api  # noqa: F401  (fixture)
from openai import BadRequestError, OpenAI

pytestmark = pytest.mark.slow

QUESTION = "How long does a password reset link stay valid?"


def client_for(api) -> OpenAI:
    return OpenAI(
        base_url="http://testserver/v1", api_key=api.key(), http_client=api.client, max_retries=0
    )


def receipt(api, receipt_id: str) -> dict:
    response = api.client.get(f"/v1/receipts/{receipt_id}", headers=api.auth())
    assert response.status_code == 200, response.text
    return response.json()["body"]


def sse_chunks(response) -> list[dict]:
    lines = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]


def test_content_parts_developer_role_and_logprobs_through_the_openai_client(api):
    client = client_for(api)
    completion = client.chat.completions.create(
        model="inherent",
        messages=[
            {"role": "developer", "content": "Answer in one sentence."},
            {"role": "user", "content": [{"type": "text", "text": "How long does a password"},
                                         {"type": "text", "text": "reset link stay valid?"}]},
        ],
        temperature=0,
        max_completion_tokens=12,
        logprobs=True,
        top_logprobs=3,
    )
    choice = completion.choices[0]
    entries = choice.logprobs.content
    assert len(entries) == completion.usage.completion_tokens > 0
    for entry in entries:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        # Greedy: the chosen token is the most likely one.
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.token == entry.top_logprobs[0].token
    assert "".join(e.token for e in entries).startswith(choice.message.content[:5])
    body = receipt(api, completion.model_extra["receipt_id"])
    assert body["inherent.request.messages"][1]["content"] == (
        "How long does a password\nreset link stay valid?"
    )
    assert body["inherent.request.messages"][0]["role"] == "developer"
    assert body["inherent.request.sampling"]["logprobs"] == 3


def test_streamed_logprobs_match_the_streamed_tokens(api):
    stream = client_for(api).chat.completions.create(
        model="inherent", messages=[{"role": "user", "content": QUESTION}], temperature=0,
        max_tokens=10, logprobs=True, stream=True, stream_options={"include_usage": True},
    )
    chunks = list(stream)
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]
    assert len(entries) == chunks[-1].usage.completion_tokens == 10
    assert all(e.top_logprobs == [] for e in entries)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
         "messages.0.content"),
        ({"messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]},
         "messages.0.content"),
        ({"messages": [{"role": "user", "content": "hi"},
                       {"role": "tool", "tool_call_id": "c1", "content": "{}"}]}, "messages.1"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
         "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format.type"),
        ({"n": 2}, "n"),
        ({"best_of": 2}, "best_of"),
        ({"top_logprobs": 2}, None),
        ({"logit_bias": {"cat": 3}}, "logit_bias"),
    ],
)
def test_unsupported_fields_and_parts_are_refused_by_name(api, extra, param):
    body = {"model": "inherent", "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 4, **extra}
    response = api.client.post("/v1/chat/completions", json=body, headers=api.auth())
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    if "content" in (param or ""):
        part = extra["messages"][0]["content"][-1]["type"]
        assert part in error["message"]


def test_openai_client_surfaces_the_refusal(api):
    with pytest.raises(BadRequestError, match="image_url"):
        client_for(api).chat.completions.create(
            model="inherent",
            messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}],
        )


def test_guidellm_chat_body_streams_exactly_the_asked_tokens(api):
    # The body guidellm's ChatCompletionsRequestHandler.format builds for a synthetic text
    # benchmark (vllm-project/guidellm src/guidellm/backends/openai/request_handlers.py):
    # content as an array of text parts, stream_options with continuous_usage_stats, and
    # max_completion_tokens + stop None + ignore_eos for exact output lengths.
    body = {
        "model": "inherent",
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_completion_tokens": 40,
        "stop": None,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        "inherent": {"retrieval": False},
    }
    response = api.client.post("/v1/chat/completions", json=body, headers=api.auth())
    assert response.status_code == 200, response.text
    chunks = sse_chunks(response)
    # continuous_usage_stats: every chunk carries the usage so far, never decreasing.
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert all("usage" in c for c in chunks) and counts == sorted(counts)
    final = chunks[-1]["usage"]
    assert final["completion_tokens"] == 40  # ignore_eos: no early stop
    body_out = receipt(api, chunks[-1]["receipt_id"])
    assert final["prompt_tokens"] == body_out["gen_ai.usage.input_tokens"]
    assert body_out["inherent.request.sampling"]["ignore_eos"] is True


def test_guidellm_completions_body(api):
    # TextCompletionsRequestHandler.format in the same guidellm file: a plain prompt,
    # max_tokens, stop None and ignore_eos.
    body = {
        "model": "inherent",
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_tokens": 24,
        "stop": None,
        "ignore_eos": True,
        "prompt": "The quick brown fox",
    }
    response = api.client.post("/v1/completions", json=body, headers=api.auth())
    assert response.status_code == 200, response.text
    chunks = sse_chunks(response)
    assert chunks[-1]["usage"]["completion_tokens"] == 24
    tokens = api.client.post("/tokenize", json={"prompt": "The quick brown fox"},
                             headers=api.auth()).json()
    assert chunks[-1]["usage"]["prompt_tokens"] == tokens["count"]


@pytest.mark.parametrize("stream", [False, True])
def test_langchain_chat_openai_body(api, stream):
    # What langchain-openai's ChatOpenAI sends (langchain-ai/langchain
    # libs/partners/openai/langchain_openai/chat_models/base.py: `_default_params` puts model,
    # stream and the set sampling fields; `_stream` adds stream_options {"include_usage": True};
    # SystemMessage/HumanMessage become system/user messages with string content).
    body = {
        "model": "inherent",
        "stream": stream,
        "temperature": 0.0,
        "max_completion_tokens": 16,
        "messages": [
            {"role": "system", "content": "You are a support assistant."},
            {"role": "user", "content": QUESTION},
        ],
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    response = api.client.post("/v1/chat/completions", json=body, headers=api.auth())
    assert response.status_code == 200, response.text
    if stream:
        chunks = sse_chunks(response)
        text = "".join(c["choices"][0]["delta"].get("content", "")
                       for c in chunks if c["choices"])
        usage = chunks[-1]["usage"]
        receipt_id = chunks[-1]["receipt_id"]
    else:
        payload = response.json()
        text, usage = payload["choices"][0]["message"]["content"], payload["usage"]
        receipt_id = payload["receipt_id"]
    body_out = receipt(api, receipt_id)
    assert body_out["inherent.output.text"] == text
    assert usage["completion_tokens"] == len(body_out["inherent.output.token_ids"]) <= 16
    assert usage["prompt_tokens"] == body_out["gen_ai.usage.input_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_min_tokens_and_penalties_are_honoured_and_recorded(api):
    plain = api.chat(QUESTION, max_tokens=30, inherent={"retrieval": False})
    penalized = api.chat(QUESTION, max_tokens=30, frequency_penalty=2.0, presence_penalty=1.0,
                         repetition_penalty=1.5, inherent={"retrieval": False})
    assert penalized["choices"][0]["message"]["content"] != plain["choices"][0]["message"]["content"]
    short = api.chat("Say hi.", max_tokens=3, inherent={"retrieval": False})
    longer = api.chat("Say hi.", max_tokens=40, min_tokens=25, inherent={"retrieval": False})
    assert longer["usage"]["completion_tokens"] >= 25
    sampling = receipt(api, penalized["receipt_id"])["inherent.request.sampling"]
    assert (sampling["frequency_penalty"], sampling["presence_penalty"],
            sampling["repetition_penalty"]) == (2.0, 1.0, 1.5)
    assert short["usage"]["completion_tokens"] <= 3


def test_completions_through_the_openai_client(api):
    client = client_for(api)
    completion = client.completions.create(
        model="inherent", prompt="Skyvault is", max_tokens=8, temperature=0, logprobs=2
    )
    choice = completion.choices[0]
    assert completion.usage.completion_tokens == len(choice.logprobs.tokens) > 0
    assert "".join(choice.logprobs.tokens) == choice.text
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)
    assert choice.logprobs.text_offset[0] == 0
    body = receipt(api, completion.model_extra["receipt_id"])
    assert body["gen_ai.operation.name"] == "text_completion"
    assert body["inherent.request.prompt"] == "Skyvault is"
    # Token-id prompt with echo, streamed.
    ids = api.client.post("/tokenize", json={"prompt": "Skyvault is"}, headers=api.auth()).json()
    stream = client.completions.create(
        model="inherent", prompt=ids["tokens"], max_tokens=8, temperature=0, echo=True,
        stream=True,
    )
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert text.endswith(choice.text) and "Skyvault is" in text
    # A completion receipt replays.
    replayed = api.client.post(f"/v1/receipts/{completion.model_extra['receipt_id']}/replay",
                               headers=api.auth()).json()
    assert replayed["context_verified"] and replayed["verdict"] in ("identical", "tokens_match")


def test_embeddings_models_and_tokenize_endpoints(api):
    client = client_for(api)
    services = api.client.app.state.services
    names = [m.id for m in client.models.list().data]
    assert names == [services.model_id, services.embedding_model_name]
    texts = ["reset link", "storage plans"]
    result = client.embeddings.create(model=services.embedding_model_name, input=texts)
    vectors = np.array([d.embedding for d in result.data], dtype=np.float32)
    assert np.array_equal(vectors, services.embedder.embed(texts))  # base64 round trip
    assert result.usage.prompt_tokens > 4
    as_floats = api.client.post("/v1/embeddings", headers=api.auth(), json={
        "model": services.embedding_model_name, "input": "reset link",
        "encoding_format": "float"}).json()
    assert as_floats["data"][0]["embedding"] == pytest.approx(vectors[0].tolist())
    tokens = api.client.post("/tokenize", headers=api.auth(), json={
        "messages": [{"role": "user", "content": "hello"}], "return_token_strs": True}).json()
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"])
    text = api.client.post("/detokenize", headers=api.auth(),
                           json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert "hello" in text and "".join(tokens["token_strs"]) == text
    assert api.client.post("/detokenize", headers=api.auth(),
                           json={"tokens": [10**9]}).status_code == 400


def test_health_version_and_request_ids(api):
    assert api.client.get("/health").status_code == 200
    assert api.client.get("/version").json()["version"]
    response = api.client.post(
        "/v1/chat/completions", headers={**api.auth(), "X-Request-Id": "trace-me-42"},
        json={"model": "inherent", "messages": [{"role": "user", "content": QUESTION}],
              "max_tokens": 4})
    assert response.headers["X-Request-Id"] == "trace-me-42"
    assert receipt(api, response.json()["receipt_id"])["inherent.request.id"] == "trace-me-42"
    streamed = api.client.post(
        "/v1/chat/completions", headers={**api.auth(), "X-Request-Id": "trace-me-43"},
        json={"model": "inherent", "messages": [{"role": "user", "content": QUESTION}],
              "max_tokens": 4, "stream": True})
    assert streamed.headers["X-Request-Id"] == "trace-me-43"
    assert streamed.text.rstrip().endswith("data: [DONE]")
    generated = api.client.get("/v1/models", headers=api.auth()).headers["X-Request-Id"]
    refused = api.client.get("/v1/models")
    assert len(generated) == 32 and refused.status_code == 401
    assert refused.headers["X-Request-Id"] != generated


def test_a_trace_joins_its_receipt_with_every_phase(api, monkeypatch):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    services = api.client.app.state.services
    monkeypatch.setattr(services, "tracer", provider.get_tracer("test"))
    reply = api.chat(QUESTION, max_tokens=6)
    receipt_id = reply["receipt_id"]
    spans = [s for s in exporter.get_finished_spans()
             if s.attributes.get("inherent.receipt_id") == receipt_id]
    by_name = {s.name: s for s in spans}
    root = by_name[f"chat {services.model_id}"]
    assert {"retrieval", "queue", "prefill", "decode", "receipt.write"} <= set(by_name)
    assert root.attributes["gen_ai.response.id"] == receipt_id
    assert root.attributes["gen_ai.operation.name"] == "chat"
    assert root.attributes["gen_ai.usage.output_tokens"] == reply["usage"]["completion_tokens"]
    for name in ("retrieval", "queue", "prefill", "decode", "receipt.write"):
        span = by_name[name]
        assert span.parent.span_id == root.context.span_id
        assert span.context.trace_id == root.context.trace_id
        assert root.start_time <= span.start_time <= span.end_time <= root.end_time
    body = receipt(api, receipt_id)
    assert root.attributes["inherent.request.id"] == body["inherent.request.id"]


def test_every_log_line_of_a_request_carries_its_id(api):
    import logging

    from gateway.request_context import JsonFormatter, RequestIdFilter

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            lines.append(self.format(record))

    handler = Collect()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("inherent")
    logger.addHandler(handler)
    previous = logger.level
    logger.setLevel(logging.INFO)
    try:
        api.client.post(
            "/v1/chat/completions", headers={**api.auth(), "X-Request-Id": "req-log-7"},
            json={"model": "inherent", "stream": True, "max_tokens": 4,
                  "messages": [{"role": "user", "content": QUESTION}]})
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)
    entries = [json.loads(line) for line in lines]
    assert entries and all(e["request_id"] == "req-log-7" for e in entries)
    assert any("chat rcpt_" in e["message"] for e in entries)


def test_retrieval_and_ingestion_metrics(api):
    api.chat(QUESTION, max_tokens=2)
    text = api.client.get("/metrics", headers=api.auth("acme", "audit")).text
    samples = {}
    for line in text.splitlines():
        if line.startswith("inherent:") and " " in line:
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    assert samples['inherent:retrieval_duration_seconds_count{stage="search"}'] >= 1
    assert samples['inherent:retrieval_chunks_count{stage="kept"}'] >= 1
    assert samples['inherent:ingestion_jobs{state="succeeded"}'] >= 1
    assert samples['inherent:ingestion_sources{status="active"}'] >= 4
    assert samples["inherent:ingestion_chunks"] >= 5
    assert samples["inherent:ingestion_chunks_embedded_total"] >= 5
    assert "inherent:ingestion_embeddings_reused_total" in samples
    assert samples["inherent:ingestion_metrics_up"] == 1
    assert samples['inherent:receipts_total{status="ok"}'] >= 1


def test_the_grafana_dashboard_reads_only_metrics_the_server_exports(api):
    import re
    from pathlib import Path

    dashboard = json.loads((Path(__file__).parent.parent / "deploy/grafana/inherent.json")
                           .read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {re.sub(r"_(bucket|sum|count|total)$", "", name)
            for e in exprs for name in re.findall(r"inherent:[a-z_]+", e)}
    exported = {re.sub(r"_total$", "", name) for name in re.findall(
        r"^# TYPE (inherent:[a-z_]+) ", api.client.get("/metrics", headers=api.auth("acme", "audit")).text, flags=re.M)}
    assert len(used) >= 15
    assert used <= exported, used - exported


def test_cli_ask_streams_and_json_outputs(api, monkeypatch):
    import httpx
    from typer.testing import CliRunner

    from gateway.cli import app

    sent = []

    def stream(method, url, **kwargs):
        sent.append(kwargs["json"])
        return api.client.stream(method, url, **kwargs)

    def request(method, url, timeout=None, **kwargs):  # the in-process client has no timeouts
        return api.client.request(method, url, **kwargs)

    monkeypatch.setattr(httpx, "stream", stream)
    monkeypatch.setattr(httpx, "request", request)
    runner = CliRunner()
    common = ["--url", "http://testserver", "--key", api.key()]
    asked = runner.invoke(app, ["ask", QUESTION, "--max-tokens", "8", *common])
    assert asked.exit_code == 0, asked.output
    assert sent[-1]["stream"] is True
    receipt_id = asked.stdout.strip().splitlines()[-1].split()[-1]
    answer = receipt(api, receipt_id)["inherent.output.text"]
    assert asked.stdout.startswith(answer)
    as_json = runner.invoke(app, ["ask", QUESTION, "--max-tokens", "8", "--json", *common])
    assert json.loads(as_json.stdout)["choices"][0]["message"]["content"] == answer
    replayed = json.loads(runner.invoke(app, ["replay", receipt_id, "--json", *common]).stdout)
    # the default mode is batch-invariant wherever the engine's kernels run: bits, not tokens
    invariant = receipt(api, receipt_id)["inherent.engine"]["batch_invariant"]
    assert replayed["verdict"] == ("identical" if invariant else "tokens_match")
    listed = json.loads(runner.invoke(app, ["receipts", "--json", *common]).stdout)
    assert receipt_id in [r["id"] for r in listed["data"]]
    sources = json.loads(runner.invoke(app, ["sources", "--json", *common]).stdout)
    assert "reset-password.md" in [s["source_id"] for s in sources["data"]]
