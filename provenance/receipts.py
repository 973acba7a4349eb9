"""The audit layer's receipts: one per request, written with its audit-log leaf in one transaction.

Field names follow the OpenTelemetry GenAI semantic conventions where one exists, so a receipt
exports as span attributes unchanged; what the conventions lack lives under ``inherent.*``.
"""

import secrets
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import and_, or_, select
from sqlalchemy.orm import Session

from provenance import audit_log
from provenance.hashing import blake3_hex
from provenance.models import Receipt, ReceiptCitation, utcnow

STATUSES = ("ok", "failed", "cancelled")


def new_receipt_id() -> str:
    return f"rcpt_{secrets.token_hex(12)}"


@dataclass(slots=True)
class ReceiptRecord:
    """Everything a receipt holds, gathered while the request runs."""

    receipt_id: str
    tenant_id: str
    api_key_id: str | None
    model_id: str
    weights_hash: str
    messages: list[dict[str, str]]
    sampling: dict[str, Any]
    engine: dict[str, Any]
    retrieval: dict[str, Any] | None
    prompt_text: str
    prompt_token_count: int
    template_version: str
    created_at: datetime = field(default_factory=utcnow)
    output_text: str = ""
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    timeline: dict[str, Any] = field(default_factory=dict)
    error: dict[str, Any] | None = None
    operation: str = "chat"  # or "text_completion" (the legacy completions API)
    completion_prompt: str | list[int] | None = None  # a text completion's prompt, as sent
    request_id: str | None = None  # X-Request-Id: joins the receipt to logs and traces

    @property
    def status(self) -> str:
        if not self.error:
            return "ok"
        # A client that went away is not a failure of the system; reviewers filter them apart.
        return "cancelled" if self.error.get("type") == "cancelled" else "failed"

    def body(self) -> dict[str, Any]:
        retrieval = self.retrieval or {}
        return {
            "receipt_id": self.receipt_id,
            "status": self.status,
            "created_at": self.created_at.isoformat(),
            "tenant_id": self.tenant_id,
            "api_key_id": self.api_key_id,
            "gen_ai.operation.name": self.operation,
            "gen_ai.provider.name": "inherent",
            "gen_ai.request.model": self.model_id,
            "gen_ai.request.temperature": self.sampling.get("temperature"),
            "gen_ai.request.top_p": self.sampling.get("top_p"),
            "gen_ai.request.top_k": self.sampling.get("top_k"),
            "gen_ai.request.max_tokens": self.sampling.get("max_tokens"),
            "gen_ai.request.seed": self.sampling.get("seed"),
            "gen_ai.request.stop_sequences": self.sampling.get("stop", []),
            "gen_ai.request.presence_penalty": self.sampling.get("presence_penalty"),
            "gen_ai.request.frequency_penalty": self.sampling.get("frequency_penalty"),
            "gen_ai.response.id": self.receipt_id,
            "gen_ai.response.model": self.model_id,
            "gen_ai.response.finish_reasons": [self.finish_reason] if self.finish_reason else [],
            "gen_ai.usage.input_tokens": self.prompt_token_count,
            "gen_ai.usage.output_tokens": len(self.output_token_ids),
            "inherent.request.id": self.request_id,
            "inherent.request.messages": self.messages,
            "inherent.request.prompt": self.completion_prompt,
            "inherent.request.sampling": self.sampling,
            "inherent.model.weights_hash": self.weights_hash,
            "inherent.engine": self.engine,
            "inherent.retrieval.enabled": self.retrieval is not None,
            "inherent.retrieval.query": retrieval.get("query"),
            "inherent.retrieval.snapshot_epoch": retrieval.get("snapshot_epoch"),
            "inherent.retrieval.embedding_model": retrieval.get("embedding_model"),
            "inherent.retrieval.chunks": retrieval.get("chunks", []),
            "inherent.prompt.template": self.template_version,
            "inherent.prompt.hash": blake3_hex(self.prompt_text),
            "inherent.output.text": self.output_text,
            "inherent.output.hash": blake3_hex(self.output_text),
            "inherent.output.token_ids": self.output_token_ids,
            "inherent.timeline": self.timeline,
            "error.type": (self.error or {}).get("type"),
            "error.message": (self.error or {}).get("message"),
        }


def write_receipt(session: Session, record: ReceiptRecord) -> Receipt:
    """Insert the receipt and append its leaf to the audit log, in the caller's transaction."""
    body = record.body()
    receipt = Receipt(
        id=record.receipt_id,
        tenant_id=record.tenant_id,
        api_key_id=record.api_key_id,
        created_at=record.created_at,
        status=record.status,
        snapshot_epoch=body["inherent.retrieval.snapshot_epoch"],
        model_id=record.model_id,
        weights_hash=record.weights_hash,
        prompt_hash=body["inherent.prompt.hash"],
        output_hash=body["inherent.output.hash"],
        body=body,
    )
    session.add(receipt)
    cited = {(c["source_id"], c["version"]) for c in body["inherent.retrieval.chunks"]}
    session.add_all(
        ReceiptCitation(receipt_id=receipt.id, source_id=s, version=v, tenant_id=receipt.tenant_id)
        for s, v in sorted(cited)
    )
    session.flush()
    audit_log.append_receipt(session, receipt)
    return receipt


def get_receipt(session: Session, tenant_id: str, receipt_id: str) -> Receipt | None:
    """A tenant's receipt, or None — the same answer whether the id is unknown or foreign."""
    receipt = session.get(Receipt, receipt_id)
    return receipt if receipt is not None and receipt.tenant_id == tenant_id else None


@dataclass(frozen=True, slots=True)
class ReceiptQuery:
    """What a reviewer searches by; every field narrows the result (None: any)."""

    receipt_id: str | None = None
    since: datetime | None = None  # created at or after
    until: datetime | None = None  # created before
    status: str | None = None
    source_id: str | None = None
    version: int | None = None  # only with source_id: receipts that cited this version of it
    newest_first: bool = False


def list_receipts(
    session: Session,
    tenant_id: str,
    query: ReceiptQuery,
    limit: int,
    after: tuple[datetime, str] | None = None,
) -> list[Receipt]:
    """A page of a tenant's receipts in (created_at, id) order; ``after`` is the last row of the
    previous page (keyset pagination: stable while new receipts arrive)."""
    statement = select(Receipt).where(Receipt.tenant_id == tenant_id)
    if query.receipt_id is not None:
        statement = statement.where(Receipt.id == query.receipt_id)
    if query.since is not None:
        statement = statement.where(Receipt.created_at >= query.since)
    if query.until is not None:
        statement = statement.where(Receipt.created_at < query.until)
    if query.status is not None:
        statement = statement.where(Receipt.status == query.status)
    if query.source_id is not None:
        cited = select(ReceiptCitation.receipt_id).where(
            ReceiptCitation.tenant_id == tenant_id, ReceiptCitation.source_id == query.source_id
        )
        if query.version is not None:
            cited = cited.where(ReceiptCitation.version == query.version)
        statement = statement.where(Receipt.id.in_(cited))
    if after is not None:
        at, last_id = after
        beyond = (
            or_(Receipt.created_at < at, and_(Receipt.created_at == at, Receipt.id < last_id))
            if query.newest_first
            else or_(Receipt.created_at > at, and_(Receipt.created_at == at, Receipt.id > last_id))
        )
        statement = statement.where(beyond)
    order = (
        (Receipt.created_at.desc(), Receipt.id.desc())
        if query.newest_first
        else (Receipt.created_at, Receipt.id)
    )
    return list(session.scalars(statement.order_by(*order).limit(limit)))
