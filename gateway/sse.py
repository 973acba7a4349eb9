"""Server-sent events as the OpenAI streaming API frames them: one JSON object per ``data:``
event, and a last ``data: [DONE]``. Written by the server, read back by the command line and
the benchmarks."""

import json
from typing import Any

PREFIX = "data: "
DONE = "[DONE]"


def event(data: dict[str, Any] | str) -> str:
    """One event: a JSON object, or the final ``DONE``."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"{PREFIX}{text}\n\n"


def payload(line: str) -> dict[str, Any] | None:
    """The object a received line carries; None for blank lines, comments and ``DONE``."""
    if not line.startswith(PREFIX) or line == PREFIX + DONE:
        return None
    return json.loads(line[len(PREFIX):])
