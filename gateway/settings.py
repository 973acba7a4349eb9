"""The API process's settings tree: what every process shares (``provenance.settings.Settings``)
and, nested under ``engine``, the engine's own ``EngineConfig``, validated once, with its
defaults in engine/config.py.

The engine's fields keep the flat names the deployments use: ``INHERENT_MAX_NUM_SEQS``,
``INHERENT_MODEL_PATH`` (``engine.model``), in the environment, in ``.env`` and as keyword
arguments. A new engine field is read as ``INHERENT_<FIELD>`` with no edit here.
"""

import dataclasses
from typing import Any

from pydantic import Field, model_validator

from engine.config import EngineConfig
from provenance.settings import Settings

# The flat names the settings used before the engine's fields were nested, where they differ.
RENAMED = {"model": "model_path", "dtype": "model_dtype", "mode": "engine_mode",
           "num_threads": "threads"}
# The server sizes the KV cache in tokens (``kv_cache_tokens``), not in blocks or bytes.
SIZED_BY_THE_SERVER = {"num_kv_blocks", "kv_cache_bytes"}
# Flat name -> engine field.
ENGINE_NAMES = {
    RENAMED.get(f.name, f.name): f.name
    for f in dataclasses.fields(EngineConfig)
    if f.name not in SIZED_BY_THE_SERVER
}


def unset(flat_name: str, value: Any) -> bool:
    """An empty value leaves the engine's default; so does ``threads=0``, which has always
    meant torch's own thread count."""
    return value == "" or (flat_name == "threads" and str(value) == "0")


class ServerSettings(Settings):
    engine: EngineConfig = Field(default_factory=EngineConfig)
    # KV cache size in tokens (all layers); 32768 tokens of SmolLM2-135M in float32 = 1.5 GB.
    kv_cache_tokens: int = Field(32768, gt=0)

    def __init__(self, **values: Any) -> None:
        # Flat engine names given as keywords (the CLI's flags) go into ``engine``, over what
        # it holds; keywords take precedence over the environment, as for every setting.
        flat = {name: values.pop(name) for name in list(values) if name in ENGINE_NAMES}
        if flat:
            engine = values.get("engine") or {}
            if isinstance(engine, EngineConfig):
                engine = dataclasses.asdict(engine)
            engine = dict(engine)
            for flat_name, value in flat.items():
                if unset(flat_name, value):
                    engine.pop(ENGINE_NAMES[flat_name], None)
                else:
                    engine[ENGINE_NAMES[flat_name]] = value
            values["engine"] = engine
        super().__init__(**values)

    @classmethod
    def settings_customise_sources(
        cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
    ):
        prefix = settings_cls.model_config["env_prefix"].lower()

        def engine_variables() -> dict[str, Any]:
            """The engine's fields from their flat variables (the environment over ``.env``),
            nested, so that an ``engine`` given as a keyword takes precedence over them."""
            fields = {
                field_name: value
                for source in (dotenv_settings, env_settings)
                for flat_name, field_name in ENGINE_NAMES.items()
                if (value := source.env_vars.get(prefix + flat_name)) is not None
                and not unset(flat_name, value)
            }
            return {"engine": fields} if fields else {}

        return init_settings, engine_variables, env_settings, dotenv_settings, file_secret_settings

    @model_validator(mode="after")
    def _size_kv_cache(self) -> "ServerSettings":
        blocks = -(-self.kv_cache_tokens // self.engine.block_size)
        if self.engine.num_kv_blocks != blocks:
            self.engine = dataclasses.replace(self.engine, num_kv_blocks=blocks)
        return self
