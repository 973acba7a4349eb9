"""What the command line, the demo and the benchmarks ask a running server."""

from typing import Any


def question(text: str, max_tokens: int, temperature: float = 0, **fields: Any) -> dict[str, Any]:
    """A chat completion request asking one question as the user; ``fields`` adds or
    overrides request fields (``stream``, ``inherent``, ...)."""
    return {
        "model": "inherent",
        "messages": [{"role": "user", "content": text}],
        "temperature": temperature,
        "max_tokens": max_tokens,
        **fields,
    }
