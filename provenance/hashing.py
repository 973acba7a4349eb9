"""BLAKE3 hex digests and the canonical JSON every hashed record is serialized with."""

import json
from typing import Any

from blake3 import blake3


def blake3_hex(data: bytes | str) -> str:
    return blake3(data.encode() if isinstance(data, str) else data).hexdigest()


def canonical_json(obj: Any) -> bytes:
    """Key-sorted, whitespace-free UTF-8 JSON: equal records always give equal bytes."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str).encode()
