"""The engine end to end: requests in, tokens out, blocks back.

The toy model (tests/engine_toy.py) reads its context back through the paged cache, so every
greedy comparison below also checks slot mapping, block tables, prefix sharing and preemption.
Tests with the bundled SmolLM2 model are at the end.
"""

import asyncio
import dataclasses
import os
import random
import threading
import time
from functools import partial
from pathlib import Path

import pytest
import torch
from engine_fixtures import needs_kernels, write_tiny_llama
from engine_toy import CharTokenizer, reference_greedy, toy_engine

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.intake import EngineOverloaded
from engine.llm_engine import LLMEngine
from engine.loader import load_checkpoint
from engine.model_files import bundled_model_path
from engine.model_runner import ModelRunner
from engine.sampling import InvalidRequest, SamplingParams
from gateway.settings import ServerSettings

GREEDY = SamplingParams(temperature=0, max_tokens=16)


def prompts(n: int, low: int = 3, high: int = 60, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(97) for _ in range(rng.randrange(low, high))] for _ in range(n)]


def assert_no_leaks(engine) -> None:
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert not engine.scheduler.has_work() and not engine.requests


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"enable_chunked_prefill": False},
        {"enable_prefix_caching": False},
        {"max_num_batched_tokens": 8, "max_num_seqs": 4},
        {"long_prefill_token_threshold": 5},
        {"block_size": 16, "num_kv_blocks": 64},
    ],
)
def test_greedy_output_matches_the_reference(config):
    engine = toy_engine(**config)
    batch = prompts(10)
    outs = engine.generate(batch, GREEDY)
    assert [o.token_ids for o in outs] == [reference_greedy(p, 16) for p in batch]
    assert all(o.finish_reason == "length" and o.num_output_tokens == 16 for o in outs)
    assert_no_leaks(engine)


def test_long_prompt_chunked_and_unchunked_agree():
    prompt = prompts(1, 100, 101)[0]
    chunked = toy_engine(max_num_batched_tokens=16)
    unchunked = toy_engine(max_num_batched_tokens=16, enable_chunked_prefill=False)
    a, b = (e.generate([prompt], GREEDY)[0] for e in (chunked, unchunked))
    assert a.token_ids == b.token_ids == reference_greedy(prompt, 16)
    assert len(a.metrics.prefill_chunks) == 7  # 100 tokens under a 16-token budget
    assert len(b.metrics.prefill_chunks) == 1


def test_preemption_under_a_tiny_cache_completes_everything_correctly():
    # 32 blocks of 4 tokens for 10 requests of up to 75 tokens each.
    engine = toy_engine(num_kv_blocks=32, max_model_len=100)
    batch = prompts(10, 20, 60, seed=1)
    outs = engine.generate(batch, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [reference_greedy(p, 16) for p in batch]
    assert sum(o.metrics.num_preemptions for o in outs) == engine.scheduler.num_preemptions
    assert_no_leaks(engine)


def test_shared_prefixes_are_computed_once_and_stay_correct():
    engine = toy_engine(max_num_batched_tokens=64)
    system = list(range(40))
    batch = [[*system, i, i + 1] for i in range(6)]
    first = engine.generate(batch[:1], GREEDY)
    rest = engine.generate(batch[1:], GREEDY)
    assert [o.token_ids for o in first + rest] == [reference_greedy(p, 16) for p in batch]
    assert all(o.metrics.num_cached_tokens == 40 for o in rest)
    assert engine.block_manager.prefix_cache_hits >= 5 * 40


def test_requests_join_and_leave_while_others_decode():
    engine = toy_engine()
    batch = prompts(6, high=10, seed=2)  # short: each is admitted in the step it arrives
    lengths = [4, 20, 7, 12, 1, 9]
    done = {}
    engine.add_request(batch[0], SamplingParams(temperature=0, max_tokens=lengths[0]), "0")
    for step in range(200):
        if step < 5:  # one new request per step while the first ones run
            i = step + 1
            engine.add_request(batch[i], SamplingParams(temperature=0, max_tokens=lengths[i]),
                               str(i))
        tokens_this_step = {}
        for out in engine.step():
            tokens_this_step[out.request_id] = out.token_ids
            done.setdefault(out.request_id, []).extend(out.token_ids)
        if step == 3:
            assert set(tokens_this_step) == {"0", "1", "2", "3", "4"}  # "4" arrived just now
        if step == 4:
            assert "0" not in tokens_this_step and "4" not in tokens_this_step  # they left
        if not engine.has_unfinished_requests():
            break
    assert {int(k): v for k, v in done.items()} == {
        i: reference_greedy(p, n) for i, (p, n) in enumerate(zip(batch, lengths, strict=True))
    }
    assert_no_leaks(engine)


def test_abort_frees_blocks_at_the_next_step():
    engine = toy_engine()
    engine.add_request(list(range(30)), SamplingParams(max_tokens=100), "a")
    engine.add_request(list(range(50, 70)), SamplingParams(max_tokens=100), "b")
    engine.step()
    engine.step()
    held = engine.block_manager.num_blocks - engine.block_manager.num_free_blocks
    assert held > 0
    engine.abort_request("a")
    engine.abort_request("b")
    outs = {o.request_id: o for o in engine.step()}
    assert outs["a"].finished and outs["a"].finish_reason == "abort"
    assert outs["b"].finished and outs["b"].finish_reason == "abort"
    assert_no_leaks(engine)


def test_seeded_sampling_is_the_same_alone_and_in_a_batch():
    mine = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20)
    prompt = [5, 6, 7, 8]
    alone = toy_engine().generate([prompt], mine)[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=n) for n in (5, 30, 12)]
    crowd = toy_engine(max_num_batched_tokens=8, max_num_seqs=4).generate(
        [*prompts(3, seed=3), prompt], [*others, mine])
    assert crowd[-1].token_ids == alone
    assert alone != reference_greedy(prompt, 20)  # it sampled


def test_unseeded_requests_differ_but_an_engine_seed_reproduces_them():
    params = SamplingParams(temperature=1.0, max_tokens=20)
    run1 = toy_engine(seed=7).generate([[1, 2, 3]] * 2, params)
    run2 = toy_engine(seed=7).generate([[1, 2, 3]] * 2, params)
    assert [o.token_ids for o in run1] == [o.token_ids for o in run2]
    assert run1[0].token_ids != run1[1].token_ids


def test_stop_token_ids_and_max_tokens():
    prompt = [7, 4, 11, 11, 14]
    expected = reference_greedy(prompt, 30)
    stop_at = expected[5]
    out = toy_engine().generate(
        [prompt], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_at]))[0]
    assert out.token_ids == expected[: expected.index(stop_at) + 1]
    assert out.finish_reason == "stop"


def text_of(tokens: list[int]) -> str:
    return "".join(chr(97 + t % 26) for t in tokens)


def test_stop_strings_are_trimmed_and_never_streamed():
    prompt = [7, 4, 11, 11, 14]
    full = text_of(reference_greedy(prompt, 30))  # "grakabzhiljtywdjfaccvjhawmpxfr"
    stop = full[10:13]
    engine = toy_engine(tokenizer=CharTokenizer())
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=30, stop=[stop, "zzz"]))
    streamed = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed.append(out.text)
            last = out
    assert "".join(streamed) == full[:10]
    assert last.finish_reason == "stop"
    assert last.num_output_tokens == 13  # the tokens that spelled the stop string were made


def test_text_streams_whole_without_stop_strings():
    prompt = [7, 4, 11, 11, 14]
    engine = toy_engine(tokenizer=CharTokenizer())
    outs = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=12,
                                                    ignore_eos=True))
    assert outs[0].text == text_of(reference_greedy(prompt, 12))


@pytest.mark.parametrize(
    "prompt, message",
    [([], "empty"), (list(range(128)), "context window"), ("text", "tokenizer")],
)
def test_invalid_requests_fail_before_any_work(prompt, message):
    engine = toy_engine(max_model_len=128)
    with pytest.raises(InvalidRequest, match=message):
        engine.add_request(prompt, GREEDY)
    assert not engine.has_unfinished_requests()


def test_token_ids_outside_the_vocabulary_are_rejected(tiny):
    engine = engine_on(tiny)
    with pytest.raises(InvalidRequest, match="token ids"):
        engine.add_request([5, tiny.config.vocab_size], GREEDY)
    with pytest.raises(InvalidRequest, match="token ids"):
        engine.add_request([-1, 5], GREEDY)


def test_generate_feeds_more_prompts_than_the_queue_holds():
    engine = toy_engine(max_waiting_requests=2)
    batch = prompts(7, seed=8)
    outs = engine.generate(batch, GREEDY)
    assert [o.token_ids for o in outs] == [reference_greedy(p, 16) for p in batch]


def test_bad_sampling_params_fail_at_add_request():
    params = SamplingParams()
    params.top_p = 0.0  # mutated after construction
    with pytest.raises(InvalidRequest, match="top_p"):
        toy_engine().add_request([1, 2], params)


def test_the_waiting_queue_is_bounded():
    engine = toy_engine(max_waiting_requests=3)
    for i in range(3):
        engine.add_request([1, 2, i], GREEDY)
    with pytest.raises(EngineOverloaded):
        engine.add_request([1, 2, 3], GREEDY)
    engine.step()  # admits the waiting requests: room again
    engine.add_request([1, 2, 3], GREEDY)


def test_duplicate_request_ids_are_rejected():
    engine = toy_engine()
    engine.add_request([1], GREEDY, "x")
    with pytest.raises(InvalidRequest, match="already in use"):
        engine.add_request([2], GREEDY, "x")


# -- the asyncio front ---------------------------------------------------------------------


@pytest.fixture
def async_engine():
    engine = AsyncEngine(toy_engine(tokenizer=CharTokenizer()))
    yield engine
    engine.shutdown()


async def collect(engine: AsyncEngine, prompt, params, request_id=None):
    return [out async for out in engine.generate(prompt, params, request_id)]


async def test_async_streams_concurrent_requests(async_engine):
    batch = prompts(5, seed=4)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    results = await asyncio.gather(*(collect(async_engine, p, params) for p in batch))
    for p, outs in zip(batch, results, strict=True):
        assert [t for o in outs for t in o.token_ids] == reference_greedy(p, 10)
        assert "".join(o.text for o in outs) == text_of(reference_greedy(p, 10))
        assert outs[-1].finished and outs[-1].metrics.num_output_tokens == 10
        assert not any(o.finished for o in outs[:-1])


async def test_async_consumer_leaving_aborts_and_frees_blocks(async_engine):
    engine = async_engine.engine
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    stream = async_engine.generate(list(range(1, 40)), params, "leaver")
    async for _ in stream:
        break
    await stream.aclose()
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        await asyncio.sleep(0.01)
    assert_no_leaks(engine)


async def test_async_task_cancellation_aborts(async_engine):
    engine = async_engine.engine
    params = SamplingParams(temperature=0, max_tokens=100_000 // 1000, ignore_eos=True)
    started = asyncio.Event()

    async def consume():
        async for _ in async_engine.generate(list(range(1, 60)), params, "cancelled"):
            started.set()
            await asyncio.sleep(10)

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        await asyncio.sleep(0.01)
    assert_no_leaks(engine)


async def test_async_invalid_request_raises_at_first_iteration(async_engine):
    with pytest.raises(InvalidRequest):
        await collect(async_engine, [], GREEDY)
    assert not async_engine._streams


async def test_async_step_failure_fails_the_requests_in_flight(async_engine):
    model = async_engine.engine.model_runner.model
    forward = model.forward

    def broken(batch, kv_cache):
        model.forward = forward  # fail once
        raise RuntimeError("kernel exploded")

    model.forward = broken
    with pytest.raises(RuntimeError, match="kernel exploded"):
        await collect(async_engine, [1, 2, 3], GREEDY)
    assert_no_leaks(async_engine.engine)
    outs = await collect(async_engine, [1, 2, 3], GREEDY)  # the engine serves on
    assert outs[-1].finished


async def test_calls_run_on_the_engine_thread_between_steps(async_engine):
    """Other compute (the API's query embeddings) runs on the engine thread, each call between
    two whole steps, while requests stream; its result or error comes back to the caller."""
    engine = async_engine.engine
    step = engine.step
    stepping = threading.Event()

    def watched_step():
        stepping.set()
        try:
            time.sleep(0.005)  # 40 steps outlast the calls below
            return step()
        finally:
            stepping.clear()

    engine.step = watched_step
    seen = []

    def call(i):
        seen.append((i, threading.current_thread().name, stepping.is_set(),
                     engine.has_unfinished_requests()))
        if i == 3:
            raise ValueError("bad input")
        return i * 10

    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    stream = asyncio.create_task(collect(async_engine, list(range(1, 30)), params))
    while engine.num_steps < 2:
        await asyncio.sleep(0.001)
    results = await asyncio.gather(
        *(asyncio.to_thread(async_engine.run_between_steps, partial(call, i)) for i in range(6)),
        return_exceptions=True,
    )
    outs = await stream
    assert [t for o in outs for t in o.token_ids] == reference_greedy(list(range(1, 30)), 40)
    assert results[:3] + results[4:] == [0, 10, 20, 40, 50]
    assert isinstance(results[3], ValueError)
    assert sorted(i for i, *_ in seen) == list(range(6))
    assert all(name == "inherent-engine" and not mid_step for _, name, mid_step, _ in seen)
    assert all(decoding for *_, decoding in seen)  # between the request's steps


def test_the_step_thread_and_its_openmp_workers_run_at_the_configured_nice_value():
    def niced_threads() -> int:
        """This process's threads at nice 7, from /proc (a stat's 19th field)."""
        count = 0
        for task in Path("/proc/self/task").iterdir():
            stat = (task / "stat").read_text()
            count += int(stat[stat.rindex(")") + 2 :].split()[16]) == 7
        return count

    def parallel_work_then_count() -> int:
        torch.ones(1 << 22).sum()  # a parallel region: this thread's OpenMP workers start
        return niced_threads()

    engine = AsyncEngine(toy_engine(tokenizer=CharTokenizer(), step_thread_nice=7))
    try:
        assert engine.run_between_steps(parallel_work_then_count) == torch.get_num_threads()
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) != 7  # ours stays
    finally:
        engine.shutdown()


def test_a_step_thread_refused_its_priority_still_serves(monkeypatch, caplog):
    def refused(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "setpriority", refused)
    engine = AsyncEngine(toy_engine(tokenizer=CharTokenizer()))
    try:
        assert engine.run_between_steps(lambda: 42) == 42
    finally:
        engine.shutdown()
    assert "the step thread keeps its priority" in caplog.text


def test_calls_after_shutdown_run_on_the_callers_thread():
    engine = AsyncEngine(toy_engine(tokenizer=CharTokenizer()))
    assert engine.run_between_steps(threading.current_thread) is engine._thread
    engine.shutdown()
    assert engine.run_between_steps(threading.current_thread) is threading.current_thread()


def test_the_caller_works_meanwhile_while_the_engine_thread_runs_its_call():
    """`meanwhile` runs on the calling thread while its call runs on the engine thread: here
    the call waits for `meanwhile` to let it finish (had the caller waited first, the call
    would time out)."""
    engine = AsyncEngine(toy_engine(tokenizer=CharTokenizer()))
    started, release = threading.Event(), threading.Event()
    callers: list[threading.Thread] = []

    def call() -> threading.Thread:
        started.set()
        assert release.wait(5)
        return threading.current_thread()

    def meanwhile() -> None:
        callers.append(threading.current_thread())
        assert started.wait(5)  # the engine thread has taken the call
        release.set()

    assert engine.run_between_steps(call, meanwhile=meanwhile) is engine._thread
    assert callers == [threading.current_thread()]
    # a failing `meanwhile` is the caller's error; the engine thread stays up
    with pytest.raises(ZeroDivisionError):
        engine.run_between_steps(lambda: None, meanwhile=lambda: 1 / 0)
    assert engine.run_between_steps(lambda: 7) == 7
    engine.shutdown()


# -- through the real Llama forward ---------------------------------------------------------


def engine_on(checkpoint, **config) -> LLMEngine:
    """An engine with its own KV cache on a loaded checkpoint."""
    config.setdefault("num_kv_blocks", 256)
    config.setdefault("block_size", 8)
    config.setdefault("max_model_len", 256)
    config.setdefault("max_num_batched_tokens", 64)
    config.setdefault("max_num_seqs", 16)
    cfg = EngineConfig(**config)
    return LLMEngine(cfg, ModelRunner.from_checkpoint(checkpoint, cfg), checkpoint.tokenizer)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random 2-layer GQA Llama (tests/engine_fixtures.py), loaded like any HF folder."""
    return load_checkpoint(write_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


def random_prompts(n: int, seed: int, low: int = 10, high: int = 150) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randrange(low, high))] for _ in range(n)]


def test_tiny_llama_chunked_batched_and_preempted_match_one_at_a_time(tiny):
    # Equal tokens whatever the batch, chunking or preemption: batch-invariant mode's promise
    # (by default bf16 matmuls reduce by the step's shape, and a near-tie may flip).
    needs_kernels()
    batch = random_prompts(8, seed=5)
    batch.append([*batch[0][:60], 7, 8, 9])  # a shared prefix
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = engine_on(tiny, max_num_seqs=1, enable_chunked_prefill=False,
                      enable_prefix_caching=False, batch_invariant=True)
    expected = [alone.generate([p], params)[0].token_ids for p in batch]
    for config in ({"max_num_batched_tokens": 32},
                   {"num_kv_blocks": 40, "max_num_batched_tokens": 48},  # preempts
                   {"enable_chunked_prefill": False}):
        engine = engine_on(tiny, batch_invariant=True, **config)
        outs = engine.generate(batch, params)
        assert [o.token_ids for o in outs] == expected, config
        if config.get("num_kv_blocks") == 40:
            assert engine.scheduler.num_preemptions > 0
        assert_no_leaks(engine)


def test_tiny_llama_seeded_sampling_alone_and_in_a_batch(tiny):
    mine = SamplingParams(temperature=0.9, top_k=50, seed=99, max_tokens=16, ignore_eos=True)
    prompt = list(range(30, 70))
    # The same draws need the same logits: batch-invariant mode (see above).
    needs_kernels()
    alone = engine_on(tiny, batch_invariant=True).generate([prompt], mine)[0].token_ids
    crowd = engine_on(tiny, max_num_batched_tokens=24, batch_invariant=True).generate(
        [*random_prompts(5, seed=6), prompt],
        [SamplingParams(temperature=1.0, max_tokens=20)] * 5 + [mine])
    assert crowd[-1].token_ids == alone


def test_engine_loads_from_config_and_streams_text(tiny):
    engine = LLMEngine.from_config(EngineConfig(model=str(tiny.path), num_kv_blocks=64,
                                                max_model_len=256, max_num_batched_tokens=64))
    assert engine.weights_hash == tiny.weights_hash
    out = engine.generate(["hello"], SamplingParams(temperature=0, max_tokens=8,
                                                    ignore_eos=True))[0]
    assert out.num_output_tokens == 8
    # Random byte tokens: bytes left incomplete at the end are not streamed (see Detokenizer).
    assert out.text == engine.tokenizer.decode(out.token_ids).rstrip("\ufffd")


def test_kv_cache_tokens_from_the_environment_size_the_engines_cache(tiny, monkeypatch):
    """INHERENT_KV_CACHE_TOKENS, through the server settings' engine config, is the number of
    token slots the engine allocates and schedules with (rounded up to whole blocks)."""
    monkeypatch.setenv("INHERENT_KV_CACHE_TOKENS", "1000")
    monkeypatch.setenv("INHERENT_MODEL_PATH", str(tiny.path))
    config = ServerSettings().engine
    engine = LLMEngine.from_config(dataclasses.replace(config, max_model_len=256))  # tiny's limit
    blocks = -(-1000 // config.block_size)
    assert engine.block_manager.num_blocks == engine.model_runner.num_kv_blocks == blocks
    assert all(layer.shape[0] == blocks for layer in engine.model_runner.kv_cache)


async def test_tiny_llama_cancelled_stream_frees_its_blocks(tiny):
    engine = AsyncEngine(engine_on(tiny))
    try:
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        stream = engine.generate(random_prompts(1, seed=7, low=100)[0], params)
        got = [await anext(stream) for _ in range(3)]
        await stream.aclose()
        assert not any(o.finished for o in got)
        for _ in range(500):
            if not engine.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        assert_no_leaks(engine.engine)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def smollm():
    needs_kernels()  # its tests compare tokens in batch-invariant mode
    return load_checkpoint(bundled_model_path())


def chat_ids(checkpoint, text: str) -> list[int]:
    return checkpoint.tokenizer.encode_chat([{"role": "user", "content": text}])


@pytest.mark.slow
def test_smollm_answers_and_chunked_equals_unchunked(smollm):
    # Equal greedy output across chunkings is what batch-invariant mode promises; by default a
    # near-tie may flip (bf16 matmuls and SDPA reduce by the step's shape).
    # Not the bare question: its first token is a near-tie ("The" against "L", 0.02 apart in
    # these numerics); with this one the greedy path never comes within 0.89 of another token.
    question = chat_ids(smollm, "What is the capital of France? Answer in one sentence.")
    engine = engine_on(smollm, block_size=16, max_model_len=1024, max_num_batched_tokens=128,
                       batch_invariant=True)
    out = engine.generate([question], SamplingParams(temperature=0, max_tokens=20))[0]
    assert "Paris" in out.text and out.finish_reason == "stop"
    # A prompt over the 128-token budget: prefilled over several steps, same greedy output.
    long = chat_ids(smollm, "Summarize: " + " ".join(
        f"Item {i} is a {['red', 'blue', 'green'][i % 3]} box." for i in range(40)))
    assert len(long) > 300
    params = SamplingParams(temperature=0, max_tokens=24)
    chunked = engine.generate([long], params)[0]
    whole = engine_on(smollm, block_size=16, max_model_len=1024, max_num_batched_tokens=128,
                      enable_chunked_prefill=False, batch_invariant=True).generate([long], params)[0]
    assert len(chunked.metrics.prefill_chunks) >= 3
    assert len(whole.metrics.prefill_chunks) == 1
    assert chunked.token_ids == whole.token_ids
    assert_no_leaks(engine)


@pytest.mark.slow
def test_smollm_batch_with_preemption_matches_alone(smollm):
    prompts_ = [chat_ids(smollm, q) for q in (
        "Name three colors.", "What is 2 + 2?", "Write a haiku about the sea.",
        "Who wrote Hamlet?", "List the planets.", "What is water made of?")]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    alone = engine_on(smollm, block_size=16, max_num_seqs=1, batch_invariant=True)
    expected = [alone.generate([p], params)[0].token_ids for p in prompts_]
    # 12 blocks of 16 tokens hold ~2 of these requests at once: the rest wait or are preempted.
    tight = engine_on(smollm, num_kv_blocks=12, block_size=16, max_model_len=192,
                      max_num_seqs=6, batch_invariant=True)
    assert [o.token_ids for o in tight.generate(prompts_, params)] == expected
    assert tight.scheduler.num_preemptions > 0
    assert_no_leaks(tight)


def test_one_requests_sampling_failure_ends_only_that_request():
    """A poisoned request (top_k beyond any tensor's range; the toy runner knows no vocabulary,
    so nothing refuses it up front) fails alone: the batch around it finishes unharmed."""
    engine = toy_engine(max_num_seqs=8)
    batch = prompts(7, seed=3)
    ids = [engine.add_request(p, GREEDY) for p in batch]
    poisoned = engine.add_request(batch[0], SamplingParams(temperature=1.0, top_k=2**64))
    finals, tokens = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finished:
                finals[out.request_id] = out
    assert finals[poisoned].finish_reason == "abort"
    assert finals[poisoned].error == "sampling failed"
    assert tokens[poisoned] == []
    for request_id, prompt in zip(ids, batch, strict=True):
        assert finals[request_id].error is None
        assert tokens[request_id] == reference_greedy(prompt, 16)
    assert_no_leaks(engine)


def test_top_k_and_logit_bias_beyond_the_vocabulary_are_refused_up_front(tiny):
    """Refused before any work, in the intake both engine modes share: a logit_bias id past the
    vocabulary used to fail the row's sampling (and hang the request in disaggregated mode)."""
    # A small cache: the default 2 GB budget, zeroed, would take seconds and is never used.
    engine = LLMEngine.from_config(
        EngineConfig(model=str(tiny.path), max_model_len=128, num_kv_blocks=64)
    )
    vocab = engine.model_runner.vocab_size
    with pytest.raises(InvalidRequest, match="top_k"):
        engine.add_request([1, 2, 3], SamplingParams(top_k=2**64))
    with pytest.raises(InvalidRequest, match="logit_bias"):
        engine.add_request([1, 2, 3], SamplingParams(logit_bias={vocab: 5.0}))
    assert engine.add_request([1, 2, 3], SamplingParams(logit_bias={vocab - 1: 5.0}))


def test_prefix_cache_is_shared_only_within_one_salt():
    """Tenant B cannot confirm tenant A's prompt through cache hits: salts split the cache."""
    engine = toy_engine(num_kv_blocks=64)
    prompt = prompts(1, low=40, high=41, seed=5)[0]

    def cached_hits(salt: str) -> int:
        before = engine.block_manager.prefix_cache_hits
        engine.generate([prompt], SamplingParams(temperature=0, max_tokens=2, cache_salt=salt))
        return engine.block_manager.prefix_cache_hits - before

    assert cached_hits("tenant-a") == 0
    assert cached_hits("tenant-b") == 0  # same tokens, other tenant: a miss
    assert cached_hits("tenant-a") >= 36  # the owner still gets its hits
