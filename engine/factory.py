"""The engine for a config: colocated (engine/llm_engine.py) or disaggregated
(engine/disaggregated.py), as `config.mode` says."""

from prometheus_client import CollectorRegistry

from engine.config import EngineConfig
from engine.disaggregated import DisaggregatedEngine
from engine.engine_protocol import Engine
from engine.llm_engine import LLMEngine


def create_engine(config: EngineConfig, registry: CollectorRegistry | None = None) -> Engine:
    """Load the model named by the config (the bundled SmolLM2-135M by default); in
    disaggregated mode, start both workers and return once they serve."""
    if config.mode == "disaggregated":
        return DisaggregatedEngine.from_config(config, registry)
    return LLMEngine.from_config(config, registry)
