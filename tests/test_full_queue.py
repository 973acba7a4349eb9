"""A full queue answers 429 through the API: the real engine, one running sequence and room for
one waiting request, on the tiny random Llama (the claim is about the queue, not the model)."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from api_support import serve_api
from engine_fixtures import write_tiny_llama
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.slow

NO_RETRIEVAL = {"retrieval": False}


@pytest.fixture(scope="module")
def crowded(tmp_path_factory):
    model = write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), max_position_embeddings=4096)
    # A zero LM-head row for the end-of-sequence token: its logit is 0 where the greedy pick's is
    # the largest of 300 random ones, so the first request decodes all its max_tokens.
    weights_file = model / "model.safetensors"
    weights = load_file(weights_file)
    weights["lm_head.weight"][2] = 0.0
    save_file(weights, weights_file, metadata={"format": "pt"})
    yield from serve_api(tmp_path_factory, ingest=False, model_path=str(model), max_num_seqs=1,
                         max_waiting_requests=1, kv_cache_tokens=8192)


def wait_for(predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.005)


def test_a_full_queue_answers_429_with_retry_after(crowded):
    api = crowded
    engine = api.client.app.state.services.engine.engine
    scheduler = engine.scheduler

    def waiting() -> int:
        return engine.num_waiting

    body = {"model": "inherent", "messages": [{"role": "user", "content": "c"}], "max_tokens": 4,
            "inherent": NO_RETRIEVAL}
    with ThreadPoolExecutor(2) as pool:
        # One request decodes for seconds (the only running slot), a second waits behind it.
        running = pool.submit(api.chat, "a", max_tokens=2000, inherent=NO_RETRIEVAL)
        wait_for(lambda: len(scheduler.running) == 1, "the first request to run")
        queued = pool.submit(api.chat, "b", max_tokens=4, inherent=NO_RETRIEVAL)
        wait_for(lambda: waiting() == 1, "the second request to wait")
        response = api.client.post("/v1/chat/completions", json=body, headers=api.auth())
        still_full = waiting() == 1 and len(scheduler.running) == 1
        long_answer, short_answer = running.result(), queued.result()
    assert still_full, "the queue drained before the third request: make the first one longer"
    assert response.status_code == 429 and response.headers["Retry-After"] == "1"
    error = response.json()["error"]
    assert error["type"] == "rate_limit_error" and "waiting" in error["message"]
    # The refused request took nothing from the two that were admitted.
    assert long_answer["usage"]["completion_tokens"] == 2000
    assert short_answer["choices"][0]["finish_reason"] == "length"
    after = api.client.post("/v1/chat/completions", json=body, headers=api.auth())
    assert after.status_code == 200, after.text
