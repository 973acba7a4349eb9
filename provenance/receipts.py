"""The audit layer's receipts: one per request, written with its audit-log leaf in one transaction.

Field names follow the OpenTelemetry GenAI semantic conventions where one exists, so a receipt
exports as span attributes unchanged; what the conventions lack lives under ``inherent.*``.
"""

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import Connection, and_, insert, or_, select
from sqlalchemy.orm import Session

from provenance import audit_log
from provenance.driver_sql import DriverStatement
from provenance.hashing import blake3_hex, canonical_members, join_members
from provenance.memory import CitedChunk
from provenance.models import Receipt, ReceiptCitation, ReceiptRow, utcnow


class ReceiptStatus(StrEnum):
    # Member names are the stored values, so no adapter can store one for the other.
    ok = "ok"
    failed = "failed"
    cancelled = "cancelled"  # the client went away


class Operation(StrEnum):
    chat = "chat"
    text_completion = "text_completion"  # the legacy completions API


STATUSES = tuple(status.value for status in ReceiptStatus)
# The conventions' request attributes, each the sampling field of that name (stored with the
# body; a reader takes them from ``sampling``).
SAMPLING_ATTRIBUTES = {
    "gen_ai.request.temperature": "temperature",
    "gen_ai.request.top_p": "top_p",
    "gen_ai.request.top_k": "top_k",
    "gen_ai.request.max_tokens": "max_tokens",
    "gen_ai.request.seed": "seed",
    "gen_ai.request.presence_penalty": "presence_penalty",
    "gen_ai.request.frequency_penalty": "frequency_penalty",
}


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
    operation: Operation = Operation.chat
    completion_prompt: str | list[int] | None = None  # a text completion's prompt, as sent
    request_id: str | None = None  # X-Request-Id: joins the receipt to logs and traces
    _request: "SerializedRequest | None" = field(default=None, init=False, repr=False)

    @property
    def status(self) -> ReceiptStatus:
        if not self.error:
            return ReceiptStatus.ok
        # A client that went away is not a failure of the system; reviewers filter them apart.
        if self.error.get("type") == "cancelled":
            return ReceiptStatus.cancelled
        return ReceiptStatus.failed

    def serialize_request(self) -> "SerializedRequest":
        """The body's attributes that the request fixed, validated and serialized once: the
        answer's path then serializes only what the answer filled in. Called while the engine
        computes the answer; should the request's fields change after, the receipt would not
        show it, so only the answer's fields (``ReceiptAnswer``) may change after this."""
        if self._request is None:
            retrieval = self.retrieval or {}
            part = ReceiptRequest(
                receipt_id=self.receipt_id,
                created_at=self.created_at.isoformat(),
                tenant_id=self.tenant_id,
                api_key_id=self.api_key_id,
                operation=self.operation,
                model=self.model_id,
                input_tokens=self.prompt_token_count,
                request_id=self.request_id,
                messages=self.messages,
                prompt=self.completion_prompt,
                sampling=self.sampling,
                weights_hash=self.weights_hash,
                engine=self.engine,
                retrieval_enabled=self.retrieval is not None,
                retrieval_query=retrieval.get("query"),
                snapshot_epoch=retrieval.get("snapshot_epoch"),
                embedding_model=retrieval.get("embedding_model"),
                chunks=retrieval.get("chunks", []),
                template=self.template_version,
                prompt_hash=blake3_hex(self.prompt_text),
            )
            self._request = SerializedRequest(part, canonical_members(part.stored_request()))
        return self._request

    def answer(self) -> "ReceiptAnswer":
        error = self.error or {}
        return ReceiptAnswer(
            status=self.status,
            finish_reasons=[self.finish_reason] if self.finish_reason else [],
            output_text=self.output_text,
            output_hash=blake3_hex(self.output_text),
            output_token_ids=self.output_token_ids,
            timeline=self.timeline,
            error_type=error.get("type"),
            error_message=error.get("message"),
        )

    def row(self) -> ReceiptRow:
        """The receipts table's row: the body's canonical JSON joined from the request's
        members (``serialize_request``) and the answer's."""
        request, answer = self.serialize_request(), self.answer()
        return ReceiptRow(
            id=self.receipt_id,
            tenant_id=self.tenant_id,
            api_key_id=self.api_key_id,
            created_at=self.created_at,
            status=self.status,
            snapshot_epoch=request.part.snapshot_epoch,
            model_id=self.model_id,
            weights_hash=self.weights_hash,
            prompt_hash=request.part.prompt_hash,
            output_hash=answer.output_hash,
            body=join_members(request.members, canonical_members(answer.stored_answer())),
        )


class ReceiptRequest(BaseModel):
    """What a receipt records of the request: known before the engine runs. Each field's alias
    is its OpenTelemetry GenAI name, or its ``inherent.*`` name where the conventions have none."""

    model_config = ConfigDict(validate_by_name=True, frozen=True)

    receipt_id: str
    created_at: str  # ISO 8601
    tenant_id: str
    api_key_id: str | None
    operation: Operation = Field(alias="gen_ai.operation.name")
    provider: str = Field("inherent", alias="gen_ai.provider.name")
    model: str = Field(alias="gen_ai.request.model")
    input_tokens: int = Field(alias="gen_ai.usage.input_tokens")
    request_id: str | None = Field(None, alias="inherent.request.id")  # X-Request-Id
    messages: list[dict[str, Any]] = Field(alias="inherent.request.messages")
    # A text completion's prompt as sent: text or token ids.
    prompt: str | list[int] | None = Field(None, alias="inherent.request.prompt")
    # Every SamplingParams field (older receipts: fewer; replay defaults the rest).
    sampling: dict[str, Any] = Field(alias="inherent.request.sampling")
    weights_hash: str = Field(alias="inherent.model.weights_hash")
    engine: dict[str, Any] = Field(alias="inherent.engine")  # the numerics that shape the bits
    retrieval_enabled: bool = Field(alias="inherent.retrieval.enabled")
    retrieval_query: str | None = Field(alias="inherent.retrieval.query")
    snapshot_epoch: int | None = Field(alias="inherent.retrieval.snapshot_epoch")
    embedding_model: str | None = Field(alias="inherent.retrieval.embedding_model")
    chunks: list[CitedChunk] = Field(alias="inherent.retrieval.chunks")  # those the prompt held
    template: str = Field(alias="inherent.prompt.template")
    prompt_hash: str = Field(alias="inherent.prompt.hash")

    def stored_request(self) -> dict[str, Any]:
        """The request's attributes as the database and the audit log hold them, with the
        conventions' attributes that repeat what the fields say."""
        return {
            **self.model_dump(mode="json", by_alias=True, include=_REQUEST_FIELDS),
            **{name: self.sampling.get(key) for name, key in SAMPLING_ATTRIBUTES.items()},
            "gen_ai.request.stop_sequences": self.sampling.get("stop", []),
            "gen_ai.response.id": self.receipt_id,
            "gen_ai.response.model": self.model,
        }


class ReceiptAnswer(BaseModel):
    """What a receipt records of the answer: filled in while the engine runs."""

    model_config = ConfigDict(validate_by_name=True, frozen=True)

    status: ReceiptStatus
    finish_reasons: list[str] = Field(alias="gen_ai.response.finish_reasons")
    output_text: str = Field(alias="inherent.output.text")
    output_hash: str = Field(alias="inherent.output.hash")
    output_token_ids: list[int] = Field(alias="inherent.output.token_ids")
    timeline: dict[str, Any] = Field(default_factory=dict, alias="inherent.timeline")
    error_type: str | None = Field(None, alias="error.type")
    error_message: str | None = Field(None, alias="error.message")

    def stored_answer(self) -> dict[str, Any]:
        return {
            **self.model_dump(mode="json", by_alias=True, include=_ANSWER_FIELDS),
            "gen_ai.usage.output_tokens": len(self.output_token_ids),
        }


_REQUEST_FIELDS = frozenset(ReceiptRequest.model_fields)
_ANSWER_FIELDS = frozenset(ReceiptAnswer.model_fields)


class ReceiptBody(ReceiptRequest, ReceiptAnswer):
    """A receipt as stored and hashed into the audit log: the request's attributes and the
    answer's. Readers go through this model (``ReceiptBody.of(receipt)``), never through the
    stored names."""

    @classmethod
    def of(cls, receipt: Receipt) -> "ReceiptBody":
        return cls.model_validate(receipt.body)


@dataclass(frozen=True, slots=True)
class SerializedRequest:
    part: ReceiptRequest
    members: dict[str, str]  # its stored attributes as canonical JSON members


def write_receipts(session: Session | Connection, records: Sequence[ReceiptRecord]) -> None:
    """Insert the receipts with their citations and append their audit leaves, in the caller's
    transaction: one statement of each kind for them all, whatever their number (a group
    commit's), and each tenant's log head locked once, tenants in order (two committers never
    wait on each other's heads in a cycle).

    On the driver's cursor, not the ORM's unit of work nor Core's execute: on every answer's
    path, their bookkeeping cost more than the database did (provenance/driver_sql.py)."""
    if not records:
        return
    rows: list[ReceiptRow] = []
    citations: list[dict[str, Any]] = []
    for record in records:
        rows.append(record.row())
        cited = record.serialize_request().part.chunks
        citations.extend(
            {"receipt_id": record.receipt_id, "source_id": source_id, "version": version,
             "tenant_id": record.tenant_id}
            for source_id, version in sorted({(c.source_id, c.version) for c in cited})
        )
    _INSERT_RECEIPT.executemany(session, [row._asdict() for row in rows])
    if citations:
        _INSERT_CITATION.executemany(session, citations)
    leaves: dict[str, list[audit_log.LeafEntry]] = {}
    for row in rows:
        leaves.setdefault(row.tenant_id, []).append(audit_log.receipt_leaf(row))
    for tenant_id in sorted(leaves):
        audit_log.append_leaves(session, tenant_id, leaves[tenant_id])


_INSERT_RECEIPT = DriverStatement(insert(Receipt.__table__), serialized=("body",))
_INSERT_CITATION = DriverStatement(insert(ReceiptCitation.__table__))


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
    status: ReceiptStatus | None = None
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
