"""The scheduling policy, driven without a model: a "step" marks the scheduled tokens computed
and appends a token to every sequence that reached its last known token."""

import pytest

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.finish_reason import FinishReason
from engine.sampling import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import Sequence, SequenceStatus


def make(num_blocks: int = 64, **config) -> Scheduler:
    config.setdefault("block_size", 4)
    config.setdefault("max_model_len", 256)
    config.setdefault("max_num_batched_tokens", 32)
    config.setdefault("max_num_seqs", 8)
    cfg = EngineConfig(num_kv_blocks=num_blocks, **config)
    return Scheduler(cfg, BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching))


def request(scheduler: Scheduler, name: str, prompt_len: int, max_tokens: int = 4,
            first_token: int = 0) -> Sequence:
    s = Sequence(name, [first_token + i for i in range(prompt_len)],
                 SamplingParams(max_tokens=max_tokens), seed=0)
    scheduler.add(s)
    return s


def step(scheduler: Scheduler) -> ScheduledBatch:
    batch = scheduler.schedule()
    scheduler.update(batch)
    for s in batch.seqs:
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(7)
            if s.num_output_tokens >= s.params.max_tokens:
                scheduler.finish(s, FinishReason.LENGTH)
    return batch


def plan(batch: ScheduledBatch) -> dict[str, int]:
    return {s.request_id: n for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)}


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000) -> int:
    steps = 0
    while scheduler.has_work():
        step(scheduler)
        steps += 1
        assert steps < max_steps, "no progress"
    bm = scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "leaked blocks"
    assert all(b.ref_count == 0 for b in bm.blocks)
    return steps


def test_long_prompt_is_prefilled_in_budget_sized_chunks():
    sched = make(max_num_batched_tokens=32)
    request(sched, "a", 100)
    assert [plan(step(sched))["a"] for _ in range(4)] == [32, 32, 32, 4]
    assert plan(step(sched)) == {"a": 1}  # then one decode token per step


def test_decodes_go_first_and_prefill_fills_the_rest():
    sched = make(max_num_batched_tokens=32)
    request(sched, "a", 10, max_tokens=50)
    request(sched, "b", 10, max_tokens=50, first_token=100)
    step(sched)
    request(sched, "c", 100, first_token=200)
    batch = step(sched)
    assert plan(batch) == {"a": 1, "b": 1, "c": 30}  # a hybrid batch under one budget
    assert batch.num_decode_tokens == 2 and batch.num_prefill_tokens == 30
    assert [s.request_id for s in batch.seqs][:2] == ["a", "b"]


def test_unfinished_prefill_goes_before_new_requests():
    sched = make(max_num_batched_tokens=32)
    request(sched, "a", 40)
    step(sched)
    request(sched, "b", 40, first_token=100)
    assert plan(step(sched)) == {"a": 8, "b": 24}


def test_per_request_prefill_cap_lets_several_prompts_progress():
    sched = make(max_num_batched_tokens=32, long_prefill_token_threshold=8)
    for name in "abc":
        request(sched, name, 50)
    assert plan(step(sched)) == {"a": 8, "b": 8, "c": 8}


def test_max_num_seqs_bounds_the_running_batch():
    sched = make(max_num_seqs=2)
    for name in "abcd":
        request(sched, name, 3, max_tokens=3)
    assert set(plan(step(sched))) == {"a", "b"}
    assert [s.request_id for s in sched.waiting] == ["c", "d"]
    steps = run_to_completion(sched)
    assert steps >= 4


def test_requests_join_and_leave_at_every_step():
    sched = make()
    request(sched, "short", 4, max_tokens=2)
    request(sched, "long", 4, max_tokens=6)
    step(sched)
    request(sched, "late", 4, max_tokens=2)
    assert set(plan(step(sched))) == {"short", "long", "late"}  # "short" leaves after this
    assert set(plan(step(sched))) == {"long", "late"}


def test_unchunked_prefills_whole_prompts_in_steps_of_their_own():
    sched = make(max_num_batched_tokens=32, enable_chunked_prefill=False)
    request(sched, "a", 10, max_tokens=20)
    step(sched)
    request(sched, "b", 100, first_token=100)
    batch = step(sched)
    assert plan(batch) == {"b": 100}  # the whole prompt, over the budget, without "a"
    assert batch.num_decode_tokens == 0
    assert plan(step(sched)) == {"a": 1, "b": 1}


def test_preemption_takes_the_newest_and_recomputes_it():
    # 6 blocks of 4 tokens; two requests that grow to 4 blocks each cannot both fit.
    sched = make(num_blocks=6, max_model_len=24)
    old = request(sched, "old", 8, max_tokens=8)
    new = request(sched, "new", 8, max_tokens=8, first_token=100)
    preempted_at = None
    for i in range(40):
        if not sched.has_work():
            break
        step(sched)
        if preempted_at is None and sched.num_preemptions:
            preempted_at = i
            assert new.status is SequenceStatus.WAITING and new.block_table == []
            assert new.num_computed_tokens == 0
            assert sched.waiting[0] is new
            assert old.status is SequenceStatus.RUNNING
    assert preempted_at is not None
    assert new.timeline.num_preemptions >= 1
    assert old.num_output_tokens == new.num_output_tokens == 8
    run_to_completion(sched)


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("caching", [True, False])
def test_tight_cache_completes_everything_without_leaks(chunked, caching):
    sched = make(num_blocks=20, max_model_len=64, max_num_batched_tokens=64,
                 enable_chunked_prefill=chunked, enable_prefix_caching=caching)
    seqs = [request(sched, f"r{i}", 10 + 7 * i, max_tokens=12, first_token=i % 3)
            for i in range(8)]
    run_to_completion(sched)
    assert sched.num_preemptions > 0
    assert all(s.num_output_tokens == 12 and s.is_finished for s in seqs)


def test_finish_frees_blocks_of_waiting_and_running_requests():
    sched = make()
    a = request(sched, "a", 20)
    step(sched)
    b = request(sched, "b", 20)
    sched.finish(a, FinishReason.ABORT)
    sched.finish(b, FinishReason.ABORT)
    assert not sched.has_work()
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    assert a.finish_reason == b.finish_reason == "abort"


def test_prefix_cache_hit_skips_computed_tokens():
    sched = make(max_num_batched_tokens=64)
    request(sched, "a", 20, max_tokens=1)
    run_to_completion(sched)
    b = request(sched, "b", 22, max_tokens=1)  # shares a's first 20 tokens: 5 full blocks
    assert plan(step(sched)) == {"b": 2}
    assert b.timeline.num_cached_tokens == 20
    assert sched.block_manager.prefix_cache_hits == 20


def test_budget_must_cover_the_seats():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_seqs=64, max_num_batched_tokens=32)


def test_hand_offs_move_a_request_between_schedulers_with_its_blocks():
    prefill, decode = make(), make()
    s = request(prefill, "a", 10)
    step(prefill)  # the whole prompt: its first token
    blocks, free = list(s.block_table), prefill.block_manager.num_free_blocks
    prefill.detach(s)
    assert prefill.num_running == 0 and s.block_table == blocks
    assert prefill.block_manager.num_free_blocks == free  # held until the KV is sent
    decode.adopt(s)
    assert decode.num_running == 1 and s.status is SequenceStatus.RUNNING
    front = Scheduler(prefill.config, BlockManager(0, 4))  # the disaggregated front's
    t = request(front, "b", 5)
    front.start_decoding(t)  # prefilled elsewhere: running, without blocks here
    assert (front.num_waiting, front.num_running) == (0, 1) and t.block_table == []
