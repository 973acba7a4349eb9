import json
import time

import pytest
from engine_toy import toy_engine
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.diagnosis import diagnose, percentile
from engine.sampling import SamplingParams
from engine.timeline import RequestTimeline


def timeline(tokens=(2.0, 2.1, 2.2, 2.5, 2.6), interfered=(False, False, True, False)
             ) -> RequestTimeline:
    t = RequestTimeline(arrival=0.0)
    t.record_prefill_chunk(0, 16, 1.0, 1.5)
    t.record_prefill_chunk(1, 16, 1.5, 2.0)
    t.record_token(tokens[0], interfered=True)  # the first token's flag means nothing
    for at, hit in zip(tokens[1:], interfered, strict=True):
        t.record_token(at, hit)
    t.finished = tokens[-1]
    return t


def test_summary_derives_the_phases():
    s = timeline().summary().to_dict()
    assert s["queue_time"] == 1.0
    assert s["ttft"] == 2.0
    assert s["prefill_time"] == 1.0
    assert s["decode_time"] == pytest.approx(0.6)
    assert s["tpot"] == pytest.approx(0.6 / 4)
    assert s["itl"] == pytest.approx([0.1, 0.1, 0.3, 0.1])
    assert s["e2e"] == 2.6
    assert len(s["prefill_chunks"]) == 2 and s["prefill_chunks"][1]["tokens"] == 16
    assert s["decode_steps"] == 4
    assert s["interference_steps"] == 1
    assert s["interfered_steps"] == [2]  # the 0.3 s gap: the review console marks that step
    assert s["interference_time"] == pytest.approx(0.2)  # 0.3 minus the 0.1 clean median


def test_interference_falls_back_to_the_engine_baseline():
    all_hit = timeline(tokens=(2.0, 2.3, 2.55), interfered=(True, True))
    assert all_hit.summary(clean_step_baseline=0.2).interference_time == pytest.approx(0.15)
    assert all_hit.summary().interference_time is None


def test_a_request_without_tokens_has_no_latencies():
    s = RequestTimeline(arrival=0.0).summary()
    assert s.ttft is None and s.tpot is None and s.itl == ()


def finished_outputs(engine, prompts, **params):
    return engine.generate(prompts, SamplingParams(temperature=0, **params))


def test_engine_timelines_hold_the_invariants():
    engine = toy_engine(max_num_batched_tokens=16)
    prompts = [[i % 90 + j for j in range(5 + 9 * i)] for i in range(6)]
    start = time.perf_counter()
    outs = finished_outputs(engine, prompts, max_tokens=7)
    wall = time.perf_counter() - start
    for out in outs:
        m = out.metrics
        # TTFT splits into time waiting and time prefilling; all of it inside the call.
        assert m.ttft == pytest.approx(m.queue_time + m.prefill_time)
        assert m.prefill_time > 0 and m.e2e <= wall
        assert len(m.itl) == m.num_output_tokens - 1 == 6
        assert m.decode_steps == 6
        assert sum(c.tokens for c in m.prefill_chunks) == m.num_prompt_tokens
        assert m.e2e >= m.ttft + m.decode_time - 1e-9
    # The 50-token prompt needs 4 chunks under a 16-token budget.
    assert len(out.metrics.prefill_chunks) >= 4


def test_the_summary_json_form_keeps_the_receipts_keys():
    out = finished_outputs(toy_engine(), [[1, 2, 3]], max_tokens=3)[0]
    d = out.metrics.to_dict()
    assert list(d) == [
        "num_output_tokens", "num_cached_tokens", "num_preemptions", "queue_time", "ttft",
        "prefill_time", "decode_time", "tpot", "itl", "e2e", "prefill_chunks", "decode_steps",
        "interference_steps", "interfered_steps", "interference_time", "clean_itl_median",
        "kv_transfer_time", "kv_transfer", "finish_reason", "num_prompt_tokens"]
    assert type(d["finish_reason"]) is str and d["finish_reason"] == "length"
    assert list(d["prefill_chunks"][0]) == ["step", "tokens", "start", "end"]
    assert json.loads(json.dumps(d)) == d  # plain JSON types only


def test_decodes_sharing_a_step_with_a_prefill_count_as_interference():
    engine = toy_engine(max_num_batched_tokens=16, long_prefill_token_threshold=8)
    engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=12), "decoder")
    engine.step()
    engine.add_request(list(range(40)), SamplingParams(temperature=0, max_tokens=1), "long")
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    # 40 prompt tokens in chunks of 8: 5 steps shared with the decoder.
    assert finals["decoder"].metrics.interference_steps == 5
    assert finals["decoder"].metrics.decode_steps == 11


def test_decodes_stalled_by_a_prefill_only_step_count_as_interference():
    engine = toy_engine(max_num_batched_tokens=16, enable_chunked_prefill=False)
    engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=8), "decoder")
    engine.step()
    engine.step()
    engine.add_request(list(range(40)), SamplingParams(temperature=0, max_tokens=1), "long")
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    m = finals["decoder"].metrics
    assert m.interference_steps == 1  # one gap spans the whole-prompt step it sat out
    gap = m.itl[1]  # token 1 came before the long prompt's step, token 2 after it
    assert m.interference_time == pytest.approx(max(0.0, gap - m.clean_itl_median))


def samples(text: str) -> dict[str, float]:
    return {
        s.name + str(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_are_exposed_with_sane_values():
    registry = CollectorRegistry()
    engine = toy_engine(num_kv_blocks=24, registry=registry, max_model_len=64,
                        long_prefill_token_threshold=4)
    prompts = [[i] * 20 + list(range(i, i + 12)) for i in range(5)]
    outs = finished_outputs(engine, prompts, max_tokens=10)
    text = generate_latest(registry).decode()
    values = samples(text)
    label = "[('model_name', 'toy')]"
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                 "request_time_per_output_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds"):
        assert f"inherent:{name}_count{label}" in values, name
    assert values[f"inherent:time_to_first_token_seconds_count{label}"] == 5
    assert values[f"inherent:inter_token_latency_seconds_count{label}"] == 5 * 9
    assert values[f"inherent:generation_tokens_total{label}"] == 50
    assert values[f"inherent:prompt_tokens_total{label}"] == 5 * 32
    assert values[f"inherent:num_requests_running{label}"] == 0
    assert values[f"inherent:num_requests_waiting{label}"] == 0
    assert values[f"inherent:kv_cache_usage_perc{label}"] == 0.0
    assert values[f"inherent:num_preemptions_total{label}"] == engine.scheduler.num_preemptions
    assert engine.scheduler.num_preemptions > 0  # 24 blocks of 4 tokens for 5 x 42 tokens
    assert values[f"inherent:prefix_cache_queries_total{label}"] >= 5 * 32
    assert values[f"inherent:prefix_cache_hits_total{label}"] == (
        engine.block_manager.prefix_cache_hits)
    ttft_sum = values[f"inherent:time_to_first_token_seconds_sum{label}"]
    assert ttft_sum == pytest.approx(sum(out.metrics.ttft for out in outs))
    success = "[('finished_reason', 'length'), ('model_name', 'toy')]"
    assert values[f"inherent:request_success_total{success}"] == 5


def test_kv_usage_gauge_tracks_running_requests():
    registry = CollectorRegistry()
    engine = toy_engine(num_kv_blocks=32, registry=registry)
    engine.add_request(list(range(30)), SamplingParams(temperature=0, max_tokens=5))
    engine.step()
    usage = registry.get_sample_value("inherent:kv_cache_usage_perc", {"model_name": "toy"})
    assert usage == pytest.approx(8 / 32)  # 30 tokens in blocks of 4
    assert registry.get_sample_value("inherent:num_requests_running",
                                     {"model_name": "toy"}) == 1


def test_two_engines_with_their_own_registries_do_not_clash():
    toy_engine(registry=CollectorRegistry())
    toy_engine(registry=CollectorRegistry())
    toy_engine()


def summary(queue, prefill, decode, interference, n=11):
    return {"queue_time": queue, "prefill_time": prefill, "ttft": queue + prefill,
            "decode_time": decode, "interference_time": interference,
            "tpot": decode / (n - 1), "itl": [decode / (n - 1)] * (n - 1),
            "interference_steps": 3 if interference else 0}


def test_diagnosis_names_the_phase_behind_each_metric():
    queued = [summary(queue=2.0, prefill=0.2, decode=1.0, interference=0.05)] * 10
    d = diagnose(queued)
    assert d["ttft"]["cause"] == "queue"
    assert d["tpot"]["cause"] == "decode"
    assert d["dominant"] == "queue"
    assert d["ttft"]["share"]["queue"] == pytest.approx(2.0 / 2.2)
    assert "queue" in d["verdict"]

    stutter = [summary(queue=0.01, prefill=0.1, decode=3.0, interference=2.0)] * 10
    d = diagnose(stutter)
    assert d["ttft"]["cause"] == "prefill"
    assert d["tpot"]["cause"] == "interference"
    assert d["tpot"]["share"]["interference"] == pytest.approx(2.0 / 3.0)
    assert d["dominant"] == "interference"


def test_diagnosis_reads_engine_summaries():
    engine = toy_engine()
    outs = finished_outputs(engine, [[1, 2, 3]] * 3, max_tokens=4)
    d = diagnose([o.metrics.to_dict() for o in outs])
    assert d["num_requests"] == 3
    assert d["ttft"]["p50"] > 0
    assert diagnose([])["num_requests"] == 0


def test_percentile_is_nearest_rank():
    assert percentile(list(range(1, 101)), 99) == 99
    assert percentile([5.0], 50) == 5.0
    assert percentile([], 50) is None
