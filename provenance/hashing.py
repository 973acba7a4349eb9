"""BLAKE3 hex digests and the canonical JSON every hashed record is serialized with."""

import json
from typing import Any

from blake3 import blake3


def blake3_hex(data: bytes | str) -> str:
    return blake3(data.encode() if isinstance(data, str) else data).hexdigest()


_CANONICAL = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str
)


def canonical_json(obj: Any) -> bytes:
    """Key-sorted, whitespace-free UTF-8 JSON: equal records always give equal bytes."""
    return _CANONICAL.encode(obj).encode()


def canonical_members(obj: dict[str, Any]) -> dict[str, str]:
    """Each member of a JSON object as ``canonical_json`` writes it, by key: ``"key":value``.
    ``join_members`` joins the members of objects that share no key into the canonical JSON
    of their union, so a part serialized early is not serialized again."""
    return {key: f"{_CANONICAL.encode(key)}:{_CANONICAL.encode(value)}" for key, value in obj.items()}


def join_members(*parts: dict[str, str]) -> str:
    """The canonical JSON text of the union of objects given as their members."""
    members = {key: member for part in parts for key, member in part.items()}
    return "{" + ",".join(members[key] for key in sorted(members)) + "}"
