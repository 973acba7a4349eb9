"""The serving engine: paged KV cache, vLLM-V1-style scheduling with chunked prefill, sampling,
per-request timelines and Prometheus metrics, behind a step loop and an asyncio front."""

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.diagnosis import diagnose
from engine.engine_protocol import Engine
from engine.factory import create_engine
from engine.finish_reason import FinishReason
from engine.intake import EngineOverloaded
from engine.llm_engine import LLMEngine
from engine.metrics import EngineMetrics
from engine.request_output import RequestOutput
from engine.sampling import InvalidRequest, SamplingParams
from engine.timeline import RequestTimeline, TimelineSummary

__all__ = [
    "AsyncEngine",
    "Engine",
    "EngineConfig",
    "EngineMetrics",
    "EngineOverloaded",
    "FinishReason",
    "InvalidRequest",
    "LLMEngine",
    "RequestOutput",
    "RequestTimeline",
    "SamplingParams",
    "TimelineSummary",
    "create_engine",
    "diagnose",
]
