"""Receipts and the audit log, for the tenant that owns them (scope ``audit``)."""

from dataclasses import asdict
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query
from starlette.concurrency import run_in_threadpool

from gateway.deps import AuditPrincipal, ServicesDep, SessionDep
from gateway.errors import APIError, not_found
from gateway.replay import ReplayRefused, plan_replay, replay
from gateway.schemas import ReceiptOut
from provenance import audit_log
from provenance.db import session_scope
from provenance.receipts import get_receipt, list_receipts

router = APIRouter(tags=["receipts"])


def receipt_out(session, receipt) -> ReceiptOut:
    return ReceiptOut(
        id=receipt.id,
        status=receipt.status,
        created_at=receipt.body["created_at"],
        body=receipt.body,
        inclusion_proof=audit_log.inclusion_proof(session, receipt.tenant_id, receipt.id),
    )


@router.get("/v1/receipts/{receipt_id}", response_model=ReceiptOut)
def read_receipt(receipt_id: str, principal: AuditPrincipal, session: SessionDep) -> ReceiptOut:
    receipt = get_receipt(session, principal.tenant_id, receipt_id)
    if receipt is None:
        raise not_found(f"receipt {receipt_id}")
    return receipt_out(session, receipt)


@router.get("/v1/receipts")
def read_receipts(
    principal: AuditPrincipal,
    session: SessionDep,
    since: Annotated[
        datetime | None, Query(description="ISO 8601 time; receipts at or after it")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> dict:
    rows = list_receipts(session, principal.tenant_id, since, limit)
    return {
        "object": "list",
        "data": [
            {
                "id": r.id,
                "status": r.status,
                "created_at": r.body["created_at"],
                "model": r.model_id,
                "snapshot_epoch": r.snapshot_epoch,
            }
            for r in rows
        ],
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


@router.post("/v1/receipts/{receipt_id}/replay")
async def replay_receipt(receipt_id: str, principal: AuditPrincipal, services: ServicesDep) -> dict:
    def load_plan():
        with session_scope(services.settings.sqlalchemy_url) as session:
            receipt = get_receipt(session, principal.tenant_id, receipt_id)
            if receipt is None:
                raise not_found(f"receipt {receipt_id}")
            return plan_replay(services, session, receipt)

    try:
        plan = await run_in_threadpool(load_plan)
    except ReplayRefused as exc:
        raise APIError(409, str(exc), code="weights_mismatch") from exc
    return asdict(await replay(services, plan))
