"""Receipts and the audit log, for the tenant that owns them (scope ``audit``)."""

import base64
import binascii
import json
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Response
from pydantic import BeforeValidator
from starlette.concurrency import run_in_threadpool

from engine.diagnosis import diagnose
from gateway.deps import AuditPrincipal, ServicesDep, SessionDep
from gateway.errors import APIError, not_found
from gateway.replay import ReplayRefused, plan_replay, rebuild_prompt, replay
from gateway.schemas import ReceiptOut
from provenance import audit_log, incident
from provenance.db import session_scope
from provenance.hashing import canonical_json
from provenance.memory import format_source
from provenance.models import Receipt, utcnow
from provenance.receipts import STATUSES, ReceiptBody, ReceiptQuery, get_receipt, list_receipts

router = APIRouter(tags=["receipts"])


def receipt_out(session, receipt: Receipt) -> ReceiptOut:
    body = ReceiptBody.of(receipt)
    leaf = audit_log.receipt_leaf_data(session, receipt)
    return ReceiptOut(
        id=receipt.id,
        status=receipt.status,
        created_at=body.created_at,
        body=receipt.body,
        inclusion_proof=audit_log.inclusion_proof(session, receipt.tenant_id, receipt.id),
        # The exact bytes behind the hashes, so a client (the review console) can recompute the
        # body hash and the leaf hash itself instead of trusting the server's verdict.
        body_canonical=canonical_json(receipt.body).decode(),
        leaf_data=None if leaf is None else leaf.decode(),
        diagnosis=diagnose([body.timeline]) if body.timeline.get("ttft") is not None else None,
    )


def owned_receipt(session, principal, receipt_id: str) -> Receipt:
    receipt = get_receipt(session, principal.tenant_id, receipt_id)
    if receipt is None:
        raise not_found(f"receipt {receipt_id}")
    return receipt


@router.get("/v1/receipts/{receipt_id}", response_model=ReceiptOut)
def read_receipt(receipt_id: str, principal: AuditPrincipal, session: SessionDep) -> ReceiptOut:
    return receipt_out(session, owned_receipt(session, principal, receipt_id))


def encode_cursor(receipt: Receipt) -> str:
    raw = json.dumps([receipt.created_at.isoformat(), receipt.id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        at, receipt_id = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        return datetime.fromisoformat(at), str(receipt_id)
    except (binascii.Error, ValueError, TypeError) as exc:
        raise APIError(
            400, "cursor is not one this API returned", param="cursor", code="invalid_cursor"
        ) from exc


def as_utc(value: datetime | None) -> datetime | None:
    """Receipts are stamped in UTC; a naive time is taken as UTC, an aware one converted."""
    if value is None:
        return None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def iso_8601(value: object) -> object:
    """An ISO 8601 string only: pydantic would also read "0.5" as seconds since 1970."""
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value)
        except ValueError as exc:
            raise ValueError("an ISO 8601 time, e.g. 2026-11-30T12:00:00Z") from exc
    return value


IsoTime = Annotated[datetime | None, BeforeValidator(iso_8601)]


@router.get("/v1/receipts")
def read_receipts(
    principal: AuditPrincipal,
    session: SessionDep,
    since: Annotated[IsoTime, Query(description="ISO 8601 time; receipts at or after it")] = None,
    until: Annotated[IsoTime, Query(description="ISO 8601 time; receipts before it")] = None,
    status: Annotated[Literal[STATUSES] | None, Query(description="ok, failed or cancelled")] = None,
    receipt_id: Annotated[str | None, Query(alias="id", description="One receipt id")] = None,
    source: Annotated[str | None, Query(description="Receipts that cited this source id")] = None,
    version: Annotated[
        int | None, Query(ge=1, description="With source: only this version of it")
    ] = None,
    order: Annotated[Literal["asc", "desc"], Query(description="By creation time")] = "asc",
    cursor: Annotated[str | None, Query(description="next_cursor of the previous page")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> dict:
    if version is not None and source is None:
        raise APIError(400, "version needs a source", param="version", code="invalid_value")
    query = ReceiptQuery(
        receipt_id=receipt_id,
        since=as_utc(since),
        until=as_utc(until),
        status=status,
        source_id=source,
        version=version,
        newest_first=order == "desc",
    )
    after = decode_cursor(cursor) if cursor else None
    # One row more than asked says whether another page follows.
    rows = list_receipts(session, principal.tenant_id, query, limit + 1, after)
    page = rows[:limit]
    return {
        "object": "list",
        "data": [receipt_summary(r) for r in page],
        "next_cursor": encode_cursor(page[-1]) if len(rows) > limit else None,
    }


def receipt_summary(receipt: Receipt) -> dict:
    """A receipt as a list shows it: the question asked and the source versions cited."""
    body = ReceiptBody.of(receipt)
    users = [m["content"] for m in body.messages if m["role"] == "user"]
    return {
        "id": receipt.id,
        "status": receipt.status,
        "created_at": body.created_at,
        "model": receipt.model_id,
        "snapshot_epoch": receipt.snapshot_epoch,
        "question": users[-1] if users else "",
        "sources": sorted({f"{c.source_id} v{c.version}" for c in body.chunks}),
    }


@router.get("/v1/receipts/{receipt_id}/context")
def receipt_context(receipt_id: str, principal: AuditPrincipal, services: ServicesDep) -> dict:
    """The exact prompt the model saw, rebuilt from the pinned chunk versions and checked against
    the receipt's prompt hash, with where each retrieved chunk sits in it."""
    with session_scope(services.settings.sqlalchemy_url) as session:
        receipt = owned_receipt(session, principal, receipt_id)
        prompt, problems = rebuild_prompt(services, session, receipt)
    chunks, position = [], 0
    for chunk in prompt.chunks:
        block = format_source(chunk)
        start = prompt.prompt_text.find(block, position)
        span = None if start < 0 else [start, start + len(block)]
        position = start + len(block) if start >= 0 else position
        chunks.append(
            {
                "rank": chunk.rank,
                "chunk_id": chunk.chunk_id,
                "source_id": chunk.source_id,
                "version": chunk.version,
                "title": chunk.title,
                "chunk_hash": chunk.chunk_hash,
                "text": chunk.text,
                "prompt_span": span,
            }
        )
    return {
        "receipt_id": receipt_id,
        "prompt_text": prompt.prompt_text,
        "prompt_verified": not problems,
        "problems": problems,
        "chunks": chunks,
    }


@router.get("/v1/audit/root")
def audit_root(principal: AuditPrincipal, session: SessionDep) -> dict:
    """The caller's tenant's tree: each tenant's log is its own."""
    size, root = audit_log.root(session, principal.tenant_id)
    return {
        "tree_size": size,
        "root": root.hex(),
        "hash": "blake3",
        "leaf_prefix": "00",
        "node_prefix": "01",
    }


@router.get("/v1/audit/consistency")
def audit_consistency(
    principal: AuditPrincipal,
    session: SessionDep,
    first: Annotated[int, Query(alias="from", ge=1)],
    second: Annotated[int, Query(alias="to", ge=1)],
) -> dict:
    size = audit_log.tree_size(session, principal.tenant_id)
    if first > second or second > size:
        raise APIError(
            400,
            f"need 1 <= from <= to <= {size} (the log's size)",
            param="to",
            code="invalid_range",
        )
    return audit_log.consistency_proof(session, principal.tenant_id, first, second)


async def run_replay(services, principal, receipt_id: str) -> dict:
    def load_plan():
        with session_scope(services.settings.sqlalchemy_url) as session:
            return plan_replay(services, session, owned_receipt(session, principal, receipt_id))

    try:
        plan = await run_in_threadpool(load_plan)
    except ReplayRefused as exc:
        raise APIError(409, str(exc), code="weights_mismatch") from exc
    return asdict(await replay(services, plan))


@router.post("/v1/receipts/{receipt_id}/replay")
async def replay_receipt(receipt_id: str, principal: AuditPrincipal, services: ServicesDep) -> dict:
    return await run_replay(services, principal, receipt_id)


@router.post("/v1/receipts/{receipt_id}/incident")
async def incident_bundle(
    receipt_id: str, principal: AuditPrincipal, services: ServicesDep
) -> Response:
    """Replay the receipt and return one self-contained file: the receipt, its inclusion proof,
    the audit root it leads to and the replay result (``inherent audit verify-bundle`` checks it)."""
    result = await run_replay(services, principal, receipt_id)

    def assemble() -> bytes:
        with session_scope(services.settings.sqlalchemy_url) as session:
            receipt = owned_receipt(session, principal, receipt_id)
            out = receipt_out(session, receipt)
            if out.inclusion_proof is None:
                raise APIError(409, f"receipt {receipt_id} is not in the audit log", code="not_logged")
            return incident.build_bundle(
                receipt={"id": out.id, "status": out.status, "created_at": out.created_at,
                         "body": out.body},
                leaf_data=out.leaf_data.encode(),
                proof=out.inclusion_proof,
                root={"tree_size": out.inclusion_proof["tree_size"],
                      "root": out.inclusion_proof["root"]},
                replay=result,
                exported_at=utcnow().isoformat(),
            )

    content = await run_in_threadpool(assemble)
    return Response(
        content,
        media_type="application/json",
        headers={"Content-Disposition": f'attachment; filename="incident-{receipt_id}.json"'},
    )
