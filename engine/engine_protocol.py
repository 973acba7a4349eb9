"""The one small interface both engine modes offer (engine/llm_engine.py, colocated, and
engine/disaggregated.py); engine/factory.py picks the mode, AsyncEngine and the gateway drive
either through this."""

from typing import Any, Protocol

from engine.config import EngineConfig
from engine.metrics import EngineMetrics
from engine.request_output import RequestOutput
from engine.sampling import SamplingParams


class Engine(Protocol):
    config: EngineConfig
    tokenizer: Any  # None when requests bring token ids
    model_id: str
    weights_hash: str | None  # what receipts record
    metrics: EngineMetrics

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival: float | None = None) -> str:
        """Queue a request (from any thread); raises InvalidRequest or EngineOverloaded
        before any work."""

    def abort_request(self, request_id: str) -> None:
        """From any thread; the request ends (with an ABORT output) at the next step."""

    def step(self) -> list[RequestOutput]:
        """One turn of the loop: the outputs of the requests that moved."""

    def fail_all(self) -> list[str]:
        """After `step()` raised: retire the requests the failure ended; their ids."""

    def has_unfinished_requests(self) -> bool: ...

    @property
    def num_waiting(self) -> int:
        """Requests queued and not yet running."""

    def is_healthy(self) -> bool:
        """It can serve right now (from any thread)."""

    def generate(self, prompts: list[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Offline: run the prompts to completion (engine/offline.py)."""
