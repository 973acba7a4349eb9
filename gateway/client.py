"""What the command line, the demo and the benchmarks ask a running server."""

from typing import Any

import httpx


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


def in_process(app: Any, key: str) -> httpx.AsyncClient:
    """A client that calls the ASGI ``app`` in this process, no socket between, with ``key``
    (start the app's lifespan first)."""
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://inherent",
        headers={"Authorization": f"Bearer {key}"},
        timeout=600,
    )
