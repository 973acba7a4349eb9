"""Serving through the HTTP API, Inherent against vLLM's OpenAI server, under the same load.

Both servers run the bundled SmolLM2-135M-Instruct on this machine, one at a time: Inherent's
gateway (`inherent serve`, embedded default, its full chat path: query embedding, retrieval,
receipt per request) and, when `bench/peers/vllm_cpu.sh setup` has run, vLLM's OpenAI server
(dtype by the CPU's bf16 instructions, as the peer script chooses). One asyncio client drives
each with `--concurrency` streams (16) of chat completions back to back for `--duration`
seconds: prompts of `--prompt-min`..`--prompt-max` tokens (300..500, from a fixed seed, new ones
each round, counted with the server's own /tokenize on the chat template; `--prompts` of them,
1,024, more than a round's requests, so each is prefilled once), `--output-tokens`
(128) each with `ignore_eos`, temperature 0. Every SSE event is parsed as it arrives. Streams still running at
the deadline are closed; their tokens so far count toward throughput. Before the first round
each server runs the same load unmeasured for `--warmup` seconds (30) on prompts of its own.
Each round's streams start together, and a round is measured only after `--settle` seconds (20)
of its load: the first burst of 16 prompts at once is not the steady state of a server under
constant load. vLLM prefills such a burst together and its streams stay in step for a while:
its time to first token p50 was 2.55 s in 60 s rounds measured from their start, 1.83 s in 60 s
measured from 20 s in, 0.76 s over a whole 120 s round (Zen 4 kind). The window counts the
tokens that arrived in it and the latencies of the requests sent in it (inter-token gaps: those
that began in it).

Reported per server: time to first token, inter-token latency (gaps between content events)
and time per output token ((last - first) / (tokens - 1), finished streams), p50/p95/p99, and
output tokens per second; then the ratios. `--rounds` alternates the servers ABBA; the JSON
carries every round and the median. Last line: one JSON object.

While the streams run on Inherent, a probe asks one question every `--probe-interval` seconds
(non-streaming, one output token) as a second tenant whose knowledge base is bench.overhead's
corpus (`--probe-docs` articles, ingested through the CLI before the server starts; the
streams' tenant has none, so their prompts reach the model as vLLM gets them). From its
Server-Timing header: the provenance overhead under load, retrieval without the query embedding
plus the receipt write, as bench.overhead defines it for one request at a time.

Both servers get the same KV cache memory, `--kv-cache-gib` (2): vLLM's CPU KV cache space, and
for Inherent as many tokens as that holds in its KV cache's dtype. Each round reports the share
of prompt tokens each server found in its prefix cache (from its /metrics): with every prompt
new, only the chat template's system prompt is found, and on Inherent the probe's question, the
same every time with its retrieved context (29 % in all, Zen 5 kind; vLLM, whose CPU blocks are
128 tokens, finds none). Fewer `--prompts` make them cycle, and a second pass is a hit wherever
the cache outlived the first. This benchmark used to cycle 96 prompts with vLLM's 2 GiB against
Inherent's default of 32,768 tokens (0.75 GB in bf16): vLLM found 71 % of its prompt tokens,
Inherent none beyond the system prompt (the least recently freed blocks go first, and a cycle
was longer than its cache), so the figures of that time (docs/architecture.md) understate
Inherent against vLLM.

    flock /tmp/inherent-bench.lock .venv/bin/python -m bench.serving [--duration 120]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import random
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench import cpu
from bench.overhead import server_timing, write_corpus
from bench.servers import (
    INHERENT_CLI,
    inherent_env,
    inherent_server,
    vllm_peer_ready,
    vllm_server,
)
from engine.config import EngineConfig
from engine.loader import config_from_gguf, read_gguf
from engine.model_files import bundled_model_path
from engine.model_runner import kv_cache_blocks
from gateway.client import question

API_KEY = "inherent-bench-serving-key-0123456789"
METRICS_TOKEN = "inherent-bench-serving-metrics-0123456789"
PROBE_TENANT = "probe"
WARMUP_ROUND = 1000  # the warm-up's prompts: a seed no measured round uses
# Common English words the tokenizer keeps whole, so a prompt's length is set word by word.
WORDS_TEXT = """
the of and to in is was for on that with as by at from his her are be this which have not one
had but all were when there can an your their more said time will about if out up them into do
so some could she these two may first then any like other over new only after also most made
many before must through back years where much way well down should because each just those
people how too little state good very make world still own see men work long get here between
both life being under never day same another know while last might us great old year off come
since against go came right used take three
"""
WORDS = WORDS_TEXT.split()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--duration", type=float, default=120, help="seconds of load per round")
    parser.add_argument("--prompt-min", type=int, default=300)
    parser.add_argument("--prompt-max", type=int, default=500)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=1024,
                        help="distinct prompts a round, cycled if its requests outnumber them")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--warmup", type=float, default=30,
                        help="seconds of the same load, on prompts of their own, that each "
                             "server runs unmeasured before its first round")
    parser.add_argument("--settle", type=float, default=20,
                        help="seconds of each round's load before its measured --duration")
    parser.add_argument("--no-vllm", action="store_true", help="only Inherent")
    parser.add_argument("--probe-interval", type=float, default=2.0,
                        help="seconds between the provenance probe's questions (0: no probe)")
    parser.add_argument("--probe-docs", type=int, default=300)
    parser.add_argument("--kv-cache-gib", type=int, default=2,
                        help="KV cache memory of each server (vLLM's VLLM_CPU_KVCACHE_SPACE; "
                        "Inherent's INHERENT_KV_CACHE_TOKENS set to match)")
    parser.add_argument("--inherent-env", action="append", default=[], metavar="NAME=VALUE",
                        help="a setting for Inherent's server, e.g. "
                        "INHERENT_MAX_NUM_BATCHED_TOKENS=96 (repeatable)")
    return parser.parse_args()


@dataclass
class Stream:
    sent: float
    token_times: list[float] = field(default_factory=list)  # arrival of each content event
    completion_tokens: int = 0
    prompt_tokens: int = 0
    finished: bool = False


@dataclass
class Target:
    name: str
    base_url: str
    model: str
    headers: dict[str, str]
    metrics_headers: dict[str, str]
    probe_headers: dict[str, str] | None = None  # the probe tenant's (Inherent only)


def kv_cache_tokens(gib: int) -> int:
    """The tokens `gib` GiB of KV cache hold for the bundled model in Inherent's KV dtype here
    (bf16 where the CPU has bf16 dot products, float32 elsewhere: what vLLM's peer picks too),
    as the engine sizes a cache from a byte budget."""
    gguf = read_gguf(bundled_model_path())
    model_config = config_from_gguf(gguf.metadata, (t.name for t in gguf.tensors))
    config = EngineConfig(kv_cache_bytes=gib << 30)
    return kv_cache_blocks(config, model_config) * config.block_size


async def prefix_cache_tokens(client: httpx.AsyncClient, target: Target) -> tuple[float, float]:
    """Prompt tokens the server has looked up in its prefix cache so far, and found."""
    response = await client.get(f"{target.base_url}/metrics", headers=target.metrics_headers)
    response.raise_for_status()
    totals = {"prefix_cache_queries": 0.0, "prefix_cache_hits": 0.0}
    for family in text_string_to_metric_families(response.text):
        name = family.name.partition(":")[2]  # vLLM's names, under "vllm:" and "inherent:"
        if name in totals:
            totals[name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return totals["prefix_cache_queries"], totals["prefix_cache_hits"]


async def prompt_tokens(client: httpx.AsyncClient, target: Target, text: str) -> int:
    response = await client.post(f"{target.base_url}/tokenize", headers=target.headers, json={
        "model": target.model, "messages": [{"role": "user", "content": text}]})
    response.raise_for_status()
    return response.json()["count"]


async def make_prompts(client: httpx.AsyncClient, target: Target, args, seed: int) -> list[str]:
    """Texts whose chat-template token counts are drawn from the range, from a fixed seed (one
    random stream a prompt, so that they can be counted eight at a time)."""
    counting = asyncio.Semaphore(8)

    async def make_prompt(number: int) -> str:
        rng = random.Random(f"{seed}-{number}")
        goal = rng.randint(args.prompt_min, args.prompt_max)
        words = [rng.choice(WORDS) for _ in range(goal)]
        for _ in range(4):  # a few corrections: the template and joins add tokens
            async with counting:
                count = await prompt_tokens(client, target, " ".join(words))
            if count == goal:
                break
            if count > goal:
                del words[goal - count:]
            else:
                words += [rng.choice(WORDS) for _ in range(goal - count)]
        return " ".join(words)

    return list(await asyncio.gather(*(make_prompt(n) for n in range(args.prompts))))


async def one_stream(client: httpx.AsyncClient, target: Target, text: str, max_tokens: int,
                     streams: list[Stream]) -> None:
    body = {
        "model": target.model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    stream = Stream(sent=time.perf_counter())
    streams.append(stream)
    async with client.stream("POST", f"{target.base_url}/v1/chat/completions",
                             headers=target.headers, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{target.name}: HTTP {response.status_code} "
                               f"{(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"{target.name}: stream error {event['error']}")
            if event.get("choices") and event["choices"][0]["delta"].get("content"):
                stream.token_times.append(time.perf_counter())
            if event.get("usage"):
                stream.completion_tokens = event["usage"]["completion_tokens"]
                stream.prompt_tokens = event["usage"]["prompt_tokens"]
    stream.finished = True


async def client_loop(client, target: Target, prompts: list[str], offset: int, args,
                      streams: list[Stream]) -> None:
    for i in range(offset, 1 << 30, args.concurrency):
        await one_stream(client, target, prompts[i % len(prompts)], args.output_tokens, streams)


def probe_tenant(data_dir: Path, docs: int) -> str:
    """The probe tenant's knowledge base and chat key, made with the CLI in the server's data
    directory before it starts; the key's secret."""
    corpus = data_dir / "probe-corpus"
    write_corpus(corpus, docs)
    env = inherent_env(data_dir)
    subprocess.run([*INHERENT_CLI, "ingest", "--tenant", PROBE_TENANT, str(corpus)], env=env,
                   check=True, capture_output=True)
    created = subprocess.run(
        [*INHERENT_CLI, "keys", "create", "--tenant", PROBE_TENANT, "--scope", "chat"],
        env=env, check=True, capture_output=True, text=True)
    return created.stdout.strip().splitlines()[-1]


async def probe(client: httpx.AsyncClient, target: Target, interval: float,
                phases_ms: dict[str, list[float]], measured_from: float) -> None:
    # One question, asked again and again: the same retrieval and receipt every time, and its
    # prompt's prefill is a prefix-cache hit, so the probe adds little work to the streams'.
    body = question("How do I change the billing settings?", 1)
    while True:
        await asyncio.sleep(interval)
        response = await client.post(f"{target.base_url}/v1/chat/completions",
                                     headers=target.probe_headers, json=body)
        response.raise_for_status()
        if not response.json()["citations"]:
            raise RuntimeError("the probe's question retrieved nothing")
        if time.perf_counter() < measured_from:
            continue
        timing = server_timing(response.headers["Server-Timing"])
        for phase in ("retrieve", "receipt"):
            phases_ms[phase].append(timing[phase])
        phases_ms["overhead"].append(timing["retrieve"] + timing["receipt"])


def percentiles(values: list[float]) -> dict[str, float | None]:
    if len(values) < 2:
        return {"p50": round(values[0], 1) if values else None, "p95": None, "p99": None}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": round(statistics.median(values), 1), "p95": round(cuts[94], 1),
            "p99": round(cuts[98], 1)}


def summarize(streams: list[Stream], start: float, end: float) -> dict:
    """The window [start, end]: its tokens, and the latencies of the requests sent in it."""
    # A stream sent and finished in the window counts its tokens by its usage (an event may
    # carry several tokens); any other by the content events that arrived in the window.
    measured = [s for s in streams if s.sent >= start]
    tokens = sum(s.completion_tokens if s.finished and s.sent >= start
                 else sum(t >= start for t in s.token_times) for s in streams)
    done = [s for s in measured if s.finished]
    ttft = [(s.token_times[0] - s.sent) * 1e3 for s in measured if s.token_times]
    itl = [(b - a) * 1e3 for s in streams
           for a, b in zip(s.token_times, s.token_times[1:], strict=False) if a >= start]
    tpot = [(s.token_times[-1] - s.token_times[0]) * 1e3 / (len(s.token_times) - 1)
            for s in done if len(s.token_times) > 1]
    return {
        "out_tok_s": round(tokens / (end - start), 2),
        "requests_finished": len(done),
        "requests_started": len(measured),
        "prompt_tokens_mean": round(statistics.mean(s.prompt_tokens for s in done), 1)
        if done else None,
        "completion_tokens_mean": round(statistics.mean(s.completion_tokens for s in done), 1)
        if done else None,
        "ttft_ms": percentiles(ttft),
        "itl_ms": percentiles(itl),
        "tpot_ms": percentiles(tpot),
    }


async def load(target: Target, args, round_number: int, duration: float,
               settle: float = 0.0) -> dict:
    """`duration` seconds of load measured after `settle` seconds of it."""
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600), limits=limits) as client:
        # Each round its own prompts, the same for both servers: both keep running between
        # rounds, and a server that ran the previous round's prompts last would serve them from
        # its prefix cache (vLLM did: 102.5 against 68.4 tok/s on the AVX2 kind).
        prompts = await make_prompts(client, target, args, args.seed + round_number)
        await one_stream(client, target, prompts[0], 4, [])  # lazy start-up costs stay out
        streams: list[Stream] = []
        start = time.perf_counter() + settle
        tasks = [asyncio.create_task(client_loop(client, target, prompts, i, args, streams))
                 for i in range(args.concurrency)]
        phases_ms: dict[str, list[float]] = {"overhead": [], "retrieve": [], "receipt": []}
        if target.probe_headers:
            tasks.append(asyncio.create_task(
                probe(client, target, args.probe_interval, phases_ms, start)))
        await asyncio.wait(tasks, timeout=settle, return_when=asyncio.FIRST_EXCEPTION)
        queries_before, hits_before = await prefix_cache_tokens(client, target)
        await asyncio.wait(tasks, timeout=start + duration - time.perf_counter(),
                           return_when=asyncio.FIRST_EXCEPTION)
        end = time.perf_counter()
        queries, hits = await prefix_cache_tokens(client, target)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task  # a failure (not a cancel) surfaces here
        await asyncio.sleep(2)  # let the server retire the closed streams before the next round
    result = summarize(streams, start, end)
    looked_up = queries - queries_before
    result["prefix_cache_hit_rate"] = round((hits - hits_before) / looked_up, 3) \
        if looked_up else None
    if target.probe_headers:
        result["provenance_overhead_ms"] = percentiles(phases_ms["overhead"])
        result["probe_retrieve_ms"] = percentiles(phases_ms["retrieve"])
        result["probe_receipt_ms"] = percentiles(phases_ms["receipt"])
        result["probe_requests"] = len(phases_ms["overhead"])
    return result


def print_row(name: str, result: dict) -> None:
    rate = result["prefix_cache_hit_rate"]
    hit_rate = "n/a" if rate is None else f"{rate:.0%}"
    print(f"  {name:9s} {result['out_tok_s']:7.1f} out tok/s | TTFT p50 "
          f"{result['ttft_ms']['p50']} ms p99 {result['ttft_ms']['p99']} | ITL p50 "
          f"{result['itl_ms']['p50']} ms p99 {result['itl_ms']['p99']} | TPOT p50 "
          f"{result['tpot_ms']['p50']} ms | {result['requests_finished']} finished, prompt "
          f"{result['prompt_tokens_mean']} tok, prefix cache hits {hit_rate}", flush=True)
    if "provenance_overhead_ms" in result:
        overhead = result["provenance_overhead_ms"]
        print(f"            provenance overhead p50 {overhead['p50']} ms p95 {overhead['p95']} "
              f"(retrieval p50 {result['probe_retrieve_ms']['p50']} ms, receipt p50 "
              f"{result['probe_receipt_ms']['p50']} ms; {result['probe_requests']} probe "
              f"questions)", flush=True)


def main() -> None:
    args = parse_args()
    with_vllm = not args.no_vllm and vllm_peer_ready()
    if not args.no_vllm and not with_vllm:
        print("vLLM peer not set up (bench/peers/vllm_cpu.sh setup): Inherent only", flush=True)
    order = ["inherent", "vllm"] if with_vllm else ["inherent"]
    machine = cpu.describe()
    rounds: list[dict[str, dict]] = []
    with tempfile.TemporaryDirectory(prefix="inherent-serving-") as scratch, \
            contextlib.ExitStack() as servers:
        data_dir = Path(scratch)
        probe_key = probe_tenant(data_dir, args.probe_docs) if args.probe_interval else None
        inherent_settings = {
            "INHERENT_KV_CACHE_TOKENS": str(kv_cache_tokens(args.kv_cache_gib)),
            "INHERENT_METRICS_TOKEN": METRICS_TOKEN,
            **dict(e.split("=", 1) for e in args.inherent_env),
        }
        print(f"KV cache: {args.kv_cache_gib} GiB for vLLM, "
              f"{inherent_settings['INHERENT_KV_CACHE_TOKENS']} tokens for Inherent", flush=True)
        targets = {"inherent": Target(
            "inherent",
            servers.enter_context(inherent_server(data_dir, API_KEY, inherent_settings)).base_url,
            "inherent",
            {"Authorization": f"Bearer {API_KEY}"},
            {"Authorization": f"Bearer {METRICS_TOKEN}"},
            {"Authorization": f"Bearer {probe_key}"} if probe_key else None)}
        if with_vllm:
            vllm_settings = {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib)}
            targets["vllm"] = Target("vllm", servers.enter_context(
                vllm_server(data_dir / "vllm.log", vllm_settings)).base_url, "smollm2", {}, {})
        # This client's own heap (torch and the loaders, imported to size prompts) stays out of
        # its garbage collections: a full one took 205-300 ms here, a stall of every stream's
        # reads that would land in whichever server's round it fell (Zen 3 kind).
        gc.collect()
        gc.freeze()
        # Unmeasured warm-up under the same load, so neither server's start-up costs land in a
        # round. (On the Xeon kind vLLM's first measured round stayed slow even after it: 68.5
        # against 171.3 out tok/s in its second; the host itself moves runs by 2x there.)
        if args.warmup > 0:
            for name in order:
                print(f"warm-up: {name} for {args.warmup:.0f} s", flush=True)
                asyncio.run(load(targets[name], args, WARMUP_ROUND, args.warmup))
        for number in range(args.rounds):
            names = order if number % 2 == 0 else order[::-1]  # ABBA
            results = {}
            print(f"round {number + 1}:", flush=True)
            for name in names:
                results[name] = asyncio.run(
                    load(targets[name], args, number, args.duration, args.settle))
                print_row(name, results[name])
            rounds.append(results)

    def median(name: str, *path: str) -> float | None:
        values = []
        for result in rounds:
            value = result[name]
            for key in path:
                value = value[key]
            values.append(value)
        # Rounded: the mean of two rounds' figures would print float noise (63.849999999999994).
        return round(statistics.median(values), 3) if None not in values else None

    summary = {
        "out_tok_s": median("inherent", "out_tok_s"),
        "itl_p50_ms": median("inherent", "itl_ms", "p50"),
        "ttft_p50_ms": median("inherent", "ttft_ms", "p50"),
        "tpot_p50_ms": median("inherent", "tpot_ms", "p50"),
        "prefix_cache_hit_rate": median("inherent", "prefix_cache_hit_rate"),
    }
    if args.probe_interval:
        summary["provenance_overhead_loaded_ms_p50"] = median(
            "inherent", "provenance_overhead_ms", "p50")
        print(f"provenance overhead under load (retrieval without the query embedding, plus the "
              f"receipt write): p50 {summary['provenance_overhead_loaded_ms_p50']} ms "
              f"(target <= 2 ms)", flush=True)
    if with_vllm:
        summary.update({
            "vllm_out_tok_s": median("vllm", "out_tok_s"),
            "vllm_itl_p50_ms": median("vllm", "itl_ms", "p50"),
            "vllm_ttft_p50_ms": median("vllm", "ttft_ms", "p50"),
            "vllm_tpot_p50_ms": median("vllm", "tpot_ms", "p50"),
            "vllm_prefix_cache_hit_rate": median("vllm", "prefix_cache_hit_rate"),
        })
        summary["ratio_vs_vllm"] = round(summary["out_tok_s"] / summary["vllm_out_tok_s"], 3)
        print(f"Inherent / vLLM output tok/s: {summary['ratio_vs_vllm']:.3f}; ITL p50 "
              f"{summary['itl_p50_ms']} vs {summary['vllm_itl_p50_ms']} ms; TTFT p50 "
              f"{summary['ttft_p50_ms']} vs {summary['vllm_ttft_p50_ms']} ms", flush=True)
    summary.update({
        "concurrency": args.concurrency, "duration_s": args.duration, "settle_s": args.settle,
        "prompt_tokens": [args.prompt_min, args.prompt_max], "output_tokens": args.output_tokens,
        "prompts": args.prompts, "kv_cache_gib": args.kv_cache_gib,
        "inherent_env": args.inherent_env, "rounds": rounds, "cpu": machine,
    })
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
