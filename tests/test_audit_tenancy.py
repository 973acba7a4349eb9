"""Audit logs and epochs are per tenant, through the HTTP API with two tenants: tenant B never
sees tenant A's tree grow or its epoch move, and cannot get a proof over A's leaves."""

import pytest
from api_support import api  # noqa: F401  (fixture)
from test_audit_log import roots_from_consistency

from provenance import merkle

pytestmark = pytest.mark.slow

B = "umbrella"  # tenant A is acme, whose corpus the fixture ingested


def audit_root(api, tenant: str) -> dict:
    response = api.client.get("/v1/audit/root", headers=api.auth(tenant))
    assert response.status_code == 200, response.text
    return response.json()


def snapshot_of(api, reply: dict, tenant: str) -> int:
    receipt = api.client.get(f"/v1/receipts/{reply['receipt_id']}", headers=api.auth(tenant))
    return receipt.json()["body"]["inherent.retrieval.snapshot_epoch"]


def inclusion_checks_out(api, reply: dict, tenant: str) -> dict:
    proof = api.client.get(
        f"/v1/receipts/{reply['receipt_id']}", headers=api.auth(tenant)
    ).json()["inclusion_proof"]
    assert merkle.verify_inclusion(
        proof["leaf_index"],
        proof["tree_size"],
        bytes.fromhex(proof["leaf_hash"]),
        [bytes.fromhex(h) for h in proof["audit_path"]],
        bytes.fromhex(proof["root"]),
    )
    return proof


def test_tenant_b_cannot_see_a_root_move_nor_prove_over_a_leaves(api):
    b_before = audit_root(api, B)
    a_before = audit_root(api, "acme")
    assert b_before["tree_size"] == 0 and a_before["tree_size"] > 0  # acme's ingestion events
    a_reply = api.chat("How do I share a file?")
    a_after = audit_root(api, "acme")
    assert a_after["tree_size"] == a_before["tree_size"] + 1
    assert audit_root(api, B) == b_before  # A's receipt left B's tree as it was

    b_reply = api.chat("How do I share a file?", tenant=B)
    b_proof = inclusion_checks_out(api, b_reply, B)
    assert (b_proof["leaf_index"], b_proof["tree_size"]) == (0, 1)
    assert audit_root(api, "acme") == a_after  # and B's left A's
    a_proof = inclusion_checks_out(api, a_reply, "acme")
    assert (a_proof["leaf_index"], a_proof["tree_size"]) == (a_after["tree_size"] - 1, a_after["tree_size"])

    # B can only name ranges of its own one-leaf log.
    over_a = api.client.get(
        "/v1/audit/consistency",
        params={"from": 1, "to": a_after["tree_size"]},
        headers=api.auth(B),
    )
    assert over_a.status_code == 400 and over_a.json()["error"]["code"] == "invalid_range"
    assert "1 <= from <= to <= 1" in over_a.json()["error"]["message"]

    # A's own consistency proof checks out under the independent RFC 6962 reading.
    first, second = a_before["tree_size"], a_after["tree_size"]
    got = api.client.get(
        "/v1/audit/consistency", params={"from": first, "to": second}, headers=api.auth("acme")
    ).json()
    hops = [bytes.fromhex(h) for h in got["consistency"]]
    old_root = bytes.fromhex(a_before["root"])
    assert roots_from_consistency(first, second, hops, old_root) == (
        old_root,
        bytes.fromhex(a_after["root"]),
    )


def test_tenant_b_epoch_stays_when_a_ingests(api, tmp_path):
    doc = tmp_path / "umbrella-faq.md"
    doc.write_text("# Umbrella\n\nOur umbrellas open in rain and close in sun.\n")
    api.ingest(B, doc)
    question = "When do umbrellas open?"
    b_epoch = snapshot_of(api, api.chat(question, tenant=B), B)
    a_epoch = snapshot_of(api, api.chat(question), "acme")

    extra = tmp_path / "acme-news.md"
    extra.write_text("# News\n\nSkyvault now keeps deleted files for 60 days.\n")
    api.ingest("acme", extra)
    assert snapshot_of(api, api.chat(question), "acme") == a_epoch + 1
    assert snapshot_of(api, api.chat(question, tenant=B), B) == b_epoch  # A's commit is not B's

    # Nor can B pin a snapshot past its own epoch, whatever A's stands at.
    ahead = api.client.post(
        "/v1/chat/completions",
        json={
            "model": "inherent",
            "messages": [{"role": "user", "content": question}],
            "max_tokens": 4,
            "inherent": {"snapshot": b_epoch + 1},
        },
        headers=api.auth(B),
    )
    assert ahead.status_code == 400 and ahead.json()["error"]["code"] == "unknown_snapshot"
    assert f"the current epoch is {b_epoch}" in ahead.json()["error"]["message"]
