"""The serving engine: paged KV cache, vLLM-V1-style scheduling with chunked prefill, sampling,
per-request timelines and Prometheus metrics, behind a step loop and an asyncio front."""

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.diagnosis import diagnose
from engine.llm_engine import EngineOverloaded, LLMEngine, RequestOutput
from engine.metrics import EngineMetrics
from engine.sampling import InvalidRequest, SamplingParams
from engine.timeline import RequestTimeline

__all__ = [
    "AsyncEngine",
    "EngineConfig",
    "EngineMetrics",
    "EngineOverloaded",
    "InvalidRequest",
    "LLMEngine",
    "RequestOutput",
    "RequestTimeline",
    "SamplingParams",
    "diagnose",
]
