"""The two worker processes of disaggregated mode.

Each runs a colocated LLMEngine (scheduler, block manager, model runner) on its own cores or GPU
and speaks with the front (engine/disaggregated.py) over a pipe:

* The prefill worker runs requests until their first token, then takes them out of its
  engine with their blocks still held (`LLMEngine.detach`). It reports the token and keeps the
  KV until the decode worker takes it (its Pull, forwarded by the front: the sender thread ships
  the blocks and they are freed) or the front lets it go (Release). Held blocks are not free:
  when hand-offs fill the cache, new prompts wait in its queue.
* The decode worker queues the front's offers and admits one only when its whole lifetime fits:
  the blocks of its prompt now plus those its remaining tokens may need, counting what the
  requests already running may still take (so it never preempts). It allocates the prompt's
  blocks, asks for the KV (Pull), receives it on its receiver thread, scatters it into those
  blocks and puts the request into its running batch (`LLMEngine.adopt`), where it continues
  from the first token.

Workers deal in token ids only, and stop on what token ids decide (EOS, stop ids, max_tokens,
context length) exactly as the front does with the same output processor; text, stop strings and
the request's timeline are the front's. A worker reports each token with the time its step
ended, on CLOCK_MONOTONIC, which every process of one host shares.

Liveness: each worker writes a Heartbeat in shared memory that the front reads: its step loop
stamps it at every turn (every `tick` seconds while idle) and at every decoder layer of a forward
(the model iterates its KV cache layer by layer: `LayerBeats`), and its transfer threads mark when
a transfer started. A frozen process or a forward or transfer that never returns stops the
stamps, whatever its other threads still do.

The messages are the dataclasses of engine/disagg_messages.py. The worker's own threads post to
the same inbox as the front's: the KV sender a Release once the KV is sent, the receiver a
Transferred once it is in place, either a TransferFailed.
"""

import contextlib
import faulthandler
import gc
import os
import queue
import signal
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.disagg_messages import (
    Abort,
    Add,
    Fatal,
    Hello,
    Inspect,
    Inspection,
    Offer,
    PrefillFacts,
    Pull,
    Release,
    StepReport,
    Stop,
    TokenReport,
    ToWorker,
    Transferred,
    WorkerStats,
)
from engine.kv_transfer import (
    DECODE_RANK,
    PREFILL_RANK,
    KVReceiver,
    KVSender,
    join_transfer_group,
)
from engine.llm_engine import LLMEngine
from engine.request_output import RequestOutput
from engine.sampler import SAMPLING_FAILED
from engine.sequence import Sequence
from engine.timeline import now


@dataclass(frozen=True, slots=True)
class TransferFailed:
    """From a transfer thread: the process group is broken, the worker must stop."""

    request_id: str
    error: str


@dataclass(slots=True)
class WorkerSpec:
    role: str  # "prefill" | "decode"
    config: EngineConfig  # this worker's own: colocated mode, its device, threads and cache
    model_path: str
    cpus: tuple[int, ...] | None  # cores to pin to (CPU), None = leave as is
    addr: str
    port: int
    backend: str  # "gloo" | "nccl"


class Heartbeat:
    """A worker's signs of life, in shared memory (CLOCK_MONOTONIC seconds, like `now()`): when
    its step loop last moved, and since when a KV transfer has been running (0: none). The
    worker writes it, the front reads it from any thread; create it before starting the
    process (with the process's multiprocessing context) and pass it as an argument."""

    def __init__(self, ctx):
        self._values = ctx.RawArray("d", 2)

    def beat(self) -> None:
        self._values[0] = now()

    def transfer(self, busy: bool) -> None:
        self._values[1] = now() if busy else 0.0

    def silence(self) -> tuple[float, float]:
        """Seconds since the loop last moved, and since the running transfer started (0 when
        none)."""
        at = now()
        loop, transfer = self._values[0], self._values[1]
        return at - loop, (at - transfer if transfer else 0.0)


class LayerBeats(list):
    """The KV cache as the model sees it: the forward iterates it once, layer by layer, and each
    layer beats, so that a long step (a big prefill chunk) is not taken for a hung one."""

    def __init__(self, layers, beat: Callable[[], None]):
        super().__init__(layers)
        self._beat = beat

    def __iter__(self):
        for layer in super().__iter__():
            self._beat()
            yield layer


class TokenIds:
    """What a worker's LLMEngine needs of a tokenizer: the EOS ids. No text: stop strings and
    detokenizing are the front's."""

    def __init__(self, eos_token_ids):
        self.eos_token_ids = tuple(eos_token_ids)

    def detokenizer(self, prompt_ids=()):
        return None


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def worker_main(spec: WorkerSpec, conn, heartbeat: Heartbeat) -> None:
    """Process entry point: load, join the transfer group, say hello, serve until stopped."""
    code = 0
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>`: every thread's stack to stderr
    try:
        worker = Worker(spec, conn, heartbeat)
        # The loaded model and modules stay out of every garbage collection's walk, which would
        # stop the worker's steps (a full one took 303-313 ms in a gateway with the same model).
        gc.collect()
        gc.freeze()
        worker.run()
    except BaseException:
        code = 1
        with contextlib.suppress(Exception):  # the front may be gone too
            conn.send(Fatal(traceback.format_exc()))
    # Skip interpreter teardown: a transfer thread may sit in a gloo call to a dead peer.
    os._exit(code)


class Worker:
    def __init__(self, spec: WorkerSpec, conn, heartbeat: Heartbeat):
        from engine.loader import load_checkpoint
        from engine.model_runner import ModelRunner

        self.role = spec.role
        self.conn = conn
        self.heartbeat = heartbeat
        config = spec.config
        self.tick = min(1.0, config.disagg_heartbeat_timeout / 4)  # longest idle wait
        if spec.cpus:
            os.sched_setaffinity(0, spec.cpus)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if torch.device(config.device).type == "cuda":
            torch.cuda.set_device(torch.device(config.device))
        checkpoint = load_checkpoint(spec.model_path)
        runner = ModelRunner.from_checkpoint(checkpoint, config)
        del checkpoint.weights  # the model holds its own copies
        self.kv_cache = runner.kv_cache  # the transfer threads' (their copies do not beat)
        runner.kv_cache = LayerBeats(runner.kv_cache, heartbeat.beat)
        self.engine = LLMEngine(config, runner, TokenIds(checkpoint.tokenizer.eos_token_ids),
                                model_id=checkpoint.model_id)
        self.block_size = config.block_size
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.seqs: dict[str, Sequence] = {}  # what the engine runs, to read timelines at the end
        self.held: dict[str, Sequence] = {}  # prefill: finished prefills waiting for hand-off
        self.offers: dict[str, Offer] = {}  # decode: offers not admitted yet, in arrival order
        self.receiving: dict[str, tuple[Sequence, float]] = {}  # decode: pulled, not arrived
        self.cancelled: set[str] = set()  # decode: aborted while their KV is on the way
        self.next_tag = 0
        self.stopping = False
        rank = PREFILL_RANK if self.role == "prefill" else DECODE_RANK
        join_transfer_group(rank, spec.addr, spec.port, spec.backend, config.disagg_start_timeout)
        if self.role == "prefill":
            self.sender = KVSender(self.kv_cache, spec.backend, self._sent, self._transfer_failed,
                                   heartbeat.transfer)
        else:
            self.receiver = KVReceiver(self.kv_cache, spec.backend, self._received,
                                       self._transfer_failed, heartbeat.transfer)
        threading.Thread(target=self._listen, name="inherent-worker-listen", daemon=True).start()
        heartbeat.beat()  # before the hello: the front watches the heartbeat from then on
        conn.send(Hello(os.getpid(), self.role, runner.num_kv_blocks, config.device,
                        torch.get_num_threads(), tuple(sorted(os.sched_getaffinity(0)))))

    # -- messages -------------------------------------------------------------------------------

    def _listen(self) -> None:
        """Drain the front's pipe at once (so the front never blocks on a send to us); a hand-off
        request goes straight to the sender thread, even while a long prefill step runs."""
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):  # the front is gone
                msg = Stop()
            match msg:
                case Pull(request_id, tag):  # the decode worker's: send it the KV
                    seq = self.held.get(request_id)
                    if seq is None:
                        self.inbox.put(TransferFailed(request_id, "no such hand-off"))
                    else:
                        self.sender.submit(request_id, list(seq.block_table), tag)
                case Stop():
                    self.inbox.put(msg)
                    return
                case _:
                    self.inbox.put(msg)

    def _sent(self, request_id: str) -> None:
        self.inbox.put(Release(request_id))  # the KV is gone: the blocks may go too

    def _received(self, request_id: str, end: float, num_bytes: int) -> None:
        _, start = self.receiving[request_id]  # set before the receive was submitted
        self.inbox.put(Transferred(request_id, start, end, num_bytes))

    def _transfer_failed(self, request_id: str, error) -> None:
        self.inbox.put(TransferFailed(request_id, repr(error)))

    def _handle(self, msg: ToWorker | Transferred | TransferFailed) -> None:
        engine = self.engine
        match msg:
            case Add(request_id, token_ids, params, arrival):
                engine.add_request(token_ids, params, request_id, arrival)
                self.seqs[request_id] = engine.requests[request_id]
            case Abort(request_id):
                if request_id in engine.requests:
                    engine.abort_request(request_id)
                elif request_id in self.offers:  # decode: never pulled, the prefill side frees it
                    del self.offers[request_id]
                    self.conn.send(Release(request_id))
                elif request_id in self.receiving:
                    self.cancelled.add(request_id)
                elif request_id in self.held:  # prefill: never offered (the front had no report)
                    engine.block_manager.free_seq(self.held.pop(request_id))
            case Release(request_id):
                seq = self.held.pop(request_id, None)
                if seq is not None:
                    engine.block_manager.free_seq(seq)
            case Offer(request_id):
                self.offers[request_id] = msg
            case Transferred():
                self._adopt(msg)
            case Inspect():
                bm = engine.block_manager
                self.conn.send(Inspection(
                    self.role, bm.num_blocks, bm.num_free_blocks,
                    sum(1 for b in bm.blocks if b.ref_count), len(engine.requests),
                    len(self.held), len(self.offers), len(self.receiving)))
            case TransferFailed(request_id, error):
                raise RuntimeError(f"KV transfer of request {request_id} failed: {error}")
            case Stop():
                self.stopping = True

    # -- the decode worker's admission ----------------------------------------------------------

    def _lifetime_blocks(self, num_prompt_tokens: int, params) -> int:
        limit = self.engine.config.max_model_len
        return blocks_for(min(num_prompt_tokens + params.max_tokens, limit), self.block_size)

    def _admit_offers(self) -> None:
        engine = self.engine
        bm = engine.block_manager
        while self.offers:
            offer = next(iter(self.offers.values()))
            if engine.scheduler.num_running + len(self.receiving) >= engine.config.max_num_seqs:
                return
            in_flight = [*engine.requests.values(), *(s for s, _ in self.receiving.values())]
            promised = sum(self._lifetime_blocks(s.num_prompt_tokens, s.params)
                           - len(s.block_table) for s in in_flight)
            needed = self._lifetime_blocks(offer.num_prompt_tokens, offer.params)
            if bm.num_free_blocks - promised < needed:
                return  # back-pressure: the prefill worker keeps holding it
            request_id, num_prompt = offer.request_id, offer.num_prompt_tokens
            del self.offers[request_id]
            seq = Sequence(request_id, list(offer.token_ids), offer.params, offer.params.seed,
                           num_prompt_tokens=num_prompt)
            seq.timeline.token_times.append(offer.first_token_at)
            bm.allocate(seq, num_prompt)
            self.receiving[request_id] = (seq, now())
            tag = self.next_tag
            self.next_tag += 1
            self.receiver.submit(request_id, list(seq.block_table), tag)
            self.conn.send(Pull(request_id, tag))

    def _adopt(self, transferred: Transferred) -> None:
        """Its KV is in its blocks: it decodes from the next step on (the front hears so)."""
        request_id = transferred.request_id
        seq, _ = self.receiving.pop(request_id)
        if request_id in self.cancelled:
            self.cancelled.discard(request_id)
            self.engine.block_manager.free_seq(seq)
            return
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.engine.adopt(seq)
        self.seqs[request_id] = seq
        self.conn.send(transferred)

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> None:
        engine = self.engine
        stalled = False  # the last step had nothing to run (e.g. held hand-offs fill the cache)
        while not self.stopping:
            self.heartbeat.beat()
            if self.role == "decode":  # before waiting: a finished request may make room
                self._admit_offers()
            block = stalled or not engine.has_unfinished_requests()
            messages = self._messages(block)
            for msg in messages:
                self._handle(msg)
            if block and not messages:
                continue  # a heartbeat tick: still nothing to do
            if self.stopping or not engine.has_unfinished_requests():
                continue
            steps, prefill_steps = engine.num_steps, engine.num_prefill_steps
            start = now()
            outputs = engine.step()
            stalled = engine.num_steps == steps and not outputs
            if stalled:
                continue  # wait for a message: a release or a finished send frees blocks
            clean = engine.num_prefill_steps == prefill_steps
            self._report(outputs, now() - start if clean else None)

    def _messages(self, block: bool) -> list[ToWorker | Transferred | TransferFailed]:
        """What the inbox holds; with `block`, wait up to a heartbeat tick for a message."""
        messages = []
        try:
            while True:
                wait = block and not messages
                messages.append(self.inbox.get(timeout=self.tick) if wait
                                else self.inbox.get_nowait())
        except queue.Empty:
            return messages

    def _report(self, outputs: list[RequestOutput], clean_step: float | None) -> None:
        engine = self.engine
        reports = []
        for out in outputs:
            request_id = out.request_id
            seq = self.seqs.get(request_id)
            if seq is None:
                continue
            # A row whose sampling failed ends with an error and no token: it is reported as
            # SAMPLING_FAILED, which the front's output processor ends as the colocated one
            # does (without a report the front would wait for that request forever).
            failed = out.finished and out.error is not None and not out.token_ids
            if out.token_ids or failed:
                token = SAMPLING_FAILED if failed else out.token_ids[-1]
                timeline = seq.timeline
                prefill = None
                if self.role == "prefill":
                    prefill = PrefillFacts(timeline.first_scheduled,
                                           tuple(timeline.prefill_chunks),
                                           timeline.num_cached_tokens, timeline.num_preemptions)
                interfered = timeline.interfered[-1] if timeline.interfered else False
                logprobs = seq.logprobs[-1] if seq.params.logprobs is not None else None
                reports.append(TokenReport(request_id, token,
                                           timeline.token_times[-1], interfered,
                                           out.finish_reason, prefill, logprobs))
            if out.finished:
                del self.seqs[request_id]
            elif self.role == "prefill":  # its first token: hold its KV for the decode worker
                self.held[request_id] = engine.detach(request_id)
                del self.seqs[request_id]
        bm = engine.block_manager
        stats = WorkerStats(
            engine.scheduler.num_running, engine.scheduler.num_waiting, bm.usage,
            engine.scheduler.num_preemptions, bm.prefix_cache_queries, bm.prefix_cache_hits,
            len(self.held), len(self.offers), clean_step)
        self.conn.send(StepReport(stats, reports))
