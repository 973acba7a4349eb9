"""An incident bundle: one receipt, its audit-log inclusion proof, the root it leads to and a replay
result, in one file that can be checked offline (``inherent audit verify-bundle FILE``).

What the check proves: the receipt body hashes to the ``body_hash`` its audit leaf commits to, the
leaf sits at its index in a BLAKE3 RFC 6962 tree whose root is the bundled one, and the file was
not altered after export (a BLAKE3 checksum over its canonical JSON). The root itself is only as
trustworthy as its source: compare it with a root published earlier (``inherent audit root``).
The checksum is not a signature: it catches corruption and careless edits of the replay result,
not someone who recomputes it.
"""

import json
from dataclasses import dataclass, field
from typing import Any

from provenance import merkle
from provenance.hashing import blake3_hex, canonical_json

FORMAT = "inherent-incident/1"
CHECKSUM_PREFIX = "blake3:"


def checksum(content: dict[str, Any]) -> str:
    return CHECKSUM_PREFIX + blake3_hex(canonical_json(content))


def build_bundle(
    receipt: dict[str, Any],
    leaf_data: bytes,
    proof: dict[str, Any],
    root: dict[str, Any],
    replay: dict[str, Any],
    exported_at: str,
) -> bytes:
    """The bundle's bytes: canonical JSON (so every byte is content) and a final newline."""
    content = {
        "format": FORMAT,
        "exported_at": exported_at,
        "receipt": receipt,
        "leaf_data": leaf_data.decode(),
        "inclusion_proof": {
            "leaf_index": proof["leaf_index"],
            "tree_size": proof["tree_size"],
            "audit_path": proof["audit_path"],
        },
        "audit_root": {"tree_size": root["tree_size"], "root": root["root"], "hash": "blake3"},
        "replay": replay,
    }
    return canonical_json({**content, "checksum": checksum(content)}) + b"\n"


@dataclass
class BundleReport:
    receipt_id: str | None = None
    tree_size: int | None = None
    root: str | None = None
    verdict: str | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_bundle(raw: bytes) -> BundleReport:
    """Check a bundle's bytes; every reason it fails is named in ``problems``."""
    report = BundleReport()
    try:
        bundle = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        report.problems.append(f"not valid JSON: {exc}")
        return report
    if not isinstance(bundle, dict) or bundle.get("format") != FORMAT:
        report.problems.append(f"not an incident bundle (expected format {FORMAT!r})")
        return report
    content = {k: v for k, v in bundle.items() if k != "checksum"}
    if bundle.get("checksum") != checksum(content):
        report.problems.append("checksum mismatch: the file was changed after export")
    try:
        receipt, proof, root = bundle["receipt"], bundle["inclusion_proof"], bundle["audit_root"]
        leaf_data = bundle["leaf_data"].encode()
        report.receipt_id, report.tree_size, report.root = receipt["id"], root["tree_size"], root["root"]
        report.verdict = bundle["replay"].get("verdict")
        check_leaf(receipt, json.loads(leaf_data), report.problems)
        included = proof["tree_size"] == root["tree_size"] and merkle.verify_inclusion(
            proof["leaf_index"],
            proof["tree_size"],
            merkle.leaf_hash(leaf_data),
            [bytes.fromhex(h) for h in proof["audit_path"]],
            bytes.fromhex(root["root"]),
        )
        if not included:
            report.problems.append(
                f"inclusion proof fails: leaf {proof['leaf_index']} does not lead to root "
                f"{root['root']} of a tree of {root['tree_size']} leaves"
            )
        if bundle["replay"].get("receipt_id") != receipt["id"]:
            report.problems.append("the replay result is for another receipt")
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        report.problems.append(f"malformed bundle: {type(exc).__name__}: {exc}")
    return report


def check_leaf(receipt: dict[str, Any], leaf: dict[str, Any], problems: list[str]) -> None:
    """The audit leaf must name this receipt and commit to its body."""
    payload = leaf["payload"]
    if leaf["kind"] != "receipt" or leaf["ref"] != receipt["id"]:
        problems.append(f"the audit leaf is for {leaf['kind']} {leaf['ref']}, not this receipt")
    if payload["body_hash"] != blake3_hex(canonical_json(receipt["body"])):
        problems.append("the receipt body does not hash to the body hash its audit leaf commits to")
    if payload["status"] != receipt["status"] or receipt["body"].get("receipt_id") != receipt["id"]:
        problems.append("the receipt's id or status differs from what its audit leaf records")
