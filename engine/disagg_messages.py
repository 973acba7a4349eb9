"""What the disaggregated front (engine/disaggregated.py) and its two workers
(engine/disagg_worker.py) say to each other over their pipes: one frozen dataclass a message,
dispatched with `match` on both sides, so that a new field is one edit here."""

from dataclasses import dataclass

from engine.finish_reason import FinishReason
from engine.sampling import SamplingParams
from engine.timeline import PrefillChunk

# -- front to worker ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Add:
    """Prefill worker: run this prompt to its first token."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # with the seed the front derived
    arrival: float


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class Release:
    """To the prefill worker: free a held hand-off's blocks. From the decode worker: it
    dropped an offer unpulled (the front forwards it to the prefill worker)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class Offer:
    """Decode worker: a prefilled request whose KV waits in the prefill worker."""

    request_id: str
    token_ids: list[int]  # the prompt and the first token
    num_prompt_tokens: int
    params: SamplingParams
    first_token_at: float


@dataclass(frozen=True, slots=True)
class Inspect:
    """Ask for the worker's block and request counts (answered with an Inspection)."""


@dataclass(frozen=True, slots=True)
class Stop:
    pass


# -- worker to front ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello:
    """The worker serves."""

    pid: int
    role: str
    num_kv_blocks: int
    device: str
    threads: int  # torch threads
    cpus: tuple[int, ...]  # the cores it may run on


@dataclass(frozen=True, slots=True)
class PrefillFacts:
    """What the prefill worker's timeline knows of a request, sent with its first token."""

    first_scheduled: float | None
    chunks: tuple[PrefillChunk, ...]
    num_cached_tokens: int
    num_preemptions: int


@dataclass(frozen=True, slots=True)
class TokenReport:
    request_id: str
    token: int
    at: float  # when the worker's step ended (CLOCK_MONOTONIC)
    interfered: bool  # prefill work ran since the request's previous token
    finish_reason: FinishReason | None  # the worker's, from token ids alone
    prefill: PrefillFacts | None  # on a prefill worker's (first) token
    logprobs: tuple | None  # the token's entry, when the request asks for logprobs


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """A worker's state after a step; the counters are running totals of its life."""

    running: int
    waiting: int
    kv_usage: float
    preemptions: int
    prefix_queries: int
    prefix_hits: int
    held: int  # prefill: hand-offs holding their blocks
    offers: int  # decode: offers not admitted yet
    clean_step: float | None  # the step's seconds, when it ran no prefill work


@dataclass(frozen=True, slots=True)
class StepReport:
    stats: WorkerStats
    tokens: list[TokenReport]


@dataclass(frozen=True, slots=True)
class Pull:
    """From the decode worker: it admitted an offer and waits for its KV under `tag`. The
    front forwards it to the prefill worker, which sends the KV (and then frees the blocks)."""

    request_id: str
    tag: int


@dataclass(frozen=True, slots=True)
class Transferred:
    """The decode worker has the request's KV in its blocks (pulled at `start`)."""

    request_id: str
    start: float
    end: float
    num_bytes: int


@dataclass(frozen=True, slots=True)
class Inspection:
    role: str
    num_blocks: int
    num_free_blocks: int
    blocks_referenced: int
    requests: int
    held: int
    offers: int
    receiving: int


@dataclass(frozen=True, slots=True)
class Fatal:
    """The worker failed: its traceback, sent before it exits."""

    traceback: str


ToWorker = Add | Abort | Release | Pull | Offer | Inspect | Stop
ToFront = Hello | StepReport | Pull | Release | Transferred | Inspection | Fatal
