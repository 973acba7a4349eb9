"""Replay for incident review: the receipt's pinned context, model and sampling, run again.

The verdict compares output token ids. It says ``identical`` -- a bit-for-bit claim -- only when
the receipt was produced in batch-invariant mode and this server runs the same numerics (every
engine setting the receipt records): then the answer cannot have depended on what shared its
batch. Otherwise equal tokens read ``tokens_match``: the same answer, with no claim that the
logits' bits agree. Either way ``token_agreement`` gives the fraction of positions that agree.
The drift report says what retrieval would show now and what happened to every cited source since
(changed, with a text diff; deprecated; deleted).
"""

import difflib
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from engine import SamplingParams
from gateway.services import PreparedPrompt, Services
from provenance import memory
from provenance.hashing import blake3_hex
from provenance.models import Chunk, Receipt, SourceVersion
from provenance.receipts import Operation, ReceiptBody
from provenance.truth import current_epoch


class Verdict(StrEnum):
    identical = "identical"  # the same bits: a batch-invariant receipt, the same numerics
    tokens_match = "tokens_match"  # the same tokens, no claim about the logits' bits
    diverged = "diverged"


class ReplayRefused(Exception):
    """The receipt cannot be replayed faithfully here (e.g. different model weights)."""


@dataclass(slots=True)
class ReplayPlan:
    receipt: Receipt
    body: ReceiptBody
    prompt: PreparedPrompt
    params: SamplingParams
    context_verified: bool
    problems: list[str]
    drift: dict[str, Any]


@dataclass(slots=True)
class ReplayResult:
    receipt_id: str
    verdict: Verdict | None  # None when the context could not be verified
    first_divergent_token: int | None
    original_output_hash: str
    replayed_output_hash: str | None
    context_verified: bool
    problems: list[str]
    bitwise_claim: bool  # batch-invariant receipt, replayed with the same numerics
    token_agreement: float | None
    replayed_output: str | None
    drift: dict[str, Any] = field(default_factory=dict)


def plan_replay(services: Services, session: Session, receipt: Receipt) -> ReplayPlan:
    body = ReceiptBody.of(receipt)
    if body.weights_hash != services.weights_hash:
        raise ReplayRefused(
            f"the receipt was produced with weights {body.weights_hash} but this server "
            f"runs weights {services.weights_hash}; replay needs the same model"
        )
    prompt, problems = rebuild_prompt(services, session, receipt)
    # Every sampling field the receipt recorded (older receipts: fewer, the rest default); a
    # replay reuses only its own tenant's cached prefixes.
    params = SamplingParams(**{**body.sampling, "cache_salt": body.tenant_id})
    return ReplayPlan(
        receipt, body, prompt, params, not problems, problems, drift_report(services, session, body)
    )


def rebuild_prompt(
    services: Services, session: Session, receipt: Receipt
) -> tuple[PreparedPrompt, list[str]]:
    """The exact prompt the receipt's request saw, from its pinned chunk versions, and what could
    not be verified (missing chunks, hash mismatches, a prompt that no longer hashes the same)."""
    body = ReceiptBody.of(receipt)
    problems: list[str] = []
    chunks: list[memory.RetrievedChunk] = []
    if body.retrieval_enabled:
        chunks, problems = memory.pinned_chunks(session, body.tenant_id, body.chunks)
    if body.operation == Operation.text_completion:
        prompt = services.completion_prompt(body.prompt)
    else:
        prompt = services.prompt_from_chunks(body.messages, None, chunks)
    if not problems and blake3_hex(prompt.prompt_text) != body.prompt_hash:
        problems.append(
            "the rebuilt prompt does not hash to the receipt's prompt hash (template or tokenizer changed)"
        )
    return prompt, problems


def bitwise_claim(services: Services, body: ReceiptBody) -> tuple[bool, str | None]:
    """Whether a replay of the receipt here may claim bit-identical output, and if a batch-
    invariant receipt cannot get that claim, why."""
    recorded = body.engine
    if not recorded.get("batch_invariant"):
        return False, None
    differs = sorted(k for k in recorded.keys() | services.engine_numerics.keys()
                     if recorded.get(k) != services.engine_numerics.get(k))
    if differs:
        return False, (
            "the receipt was produced in batch-invariant mode, but this server runs other "
            f"numerics ({', '.join(differs)}): only token agreement is reported"
        )
    return True, None


def verdict(
    original: list[int], replayed: list[int], bitwise: bool
) -> tuple[Verdict, int | None, float]:
    first = next(
        (i for i, (a, b) in enumerate(zip(original, replayed, strict=False)) if a != b), None
    )
    if first is None and len(original) != len(replayed):
        first = min(len(original), len(replayed))
    agreement = sum(a == b for a, b in zip(original, replayed, strict=False)) / max(
        len(original), len(replayed), 1
    )
    if first is not None:
        return Verdict.diverged, first, agreement
    return (Verdict.identical if bitwise else Verdict.tokens_match), None, agreement


async def replay(services: Services, plan: ReplayPlan) -> ReplayResult:
    bitwise, why_not = bitwise_claim(services, plan.body)
    base = dict(
        receipt_id=plan.receipt.id,
        original_output_hash=plan.body.output_hash,
        context_verified=plan.context_verified,
        problems=plan.problems + ([why_not] if why_not else []),
        bitwise_claim=bitwise,
        drift=plan.drift,
    )
    if not plan.context_verified:
        return ReplayResult(
            verdict=None,
            first_divergent_token=None,
            replayed_output_hash=None,
            token_agreement=None,
            replayed_output=None,
            **base,
        )
    text, ids = "", []
    async for out in services.engine.generate(
        plan.prompt.prompt_ids, plan.params, f"replay-{plan.receipt.id}-{id(plan)}"
    ):
        text += out.text
        ids.extend(out.token_ids)
    outcome, first, agreement = verdict(plan.body.output_token_ids, ids, bitwise)
    return ReplayResult(
        verdict=outcome,
        first_divergent_token=first,
        replayed_output_hash=blake3_hex(text),
        token_agreement=agreement,
        replayed_output=text,
        **base,
    )


def drift_report(services: Services, session: Session, body: ReceiptBody) -> dict[str, Any]:
    """What changed since the receipt: retrieval now, and the fate of each cited source."""
    if not body.retrieval_enabled:
        return {"retrieval_enabled": False}
    now_epoch = current_epoch(session, body.tenant_id)
    now = memory.retrieve(
        session,
        services.embedder,
        services.index,
        body.retrieval_query,
        body.tenant_id,
        now_epoch,
        max(len(body.chunks), 1),
        services.embed_query(body.retrieval_query)[0],
        services.settings.retrieval_min_score,
    )
    cited = {(c.source_id, c.version) for c in body.chunks}
    sources = [
        source_drift(session, body.tenant_id, source_id, version, body.chunks, now_epoch)
        for source_id, version in sorted(cited)
    ]
    then_ids = [c.chunk_id for c in body.chunks]
    now_ids = [c.chunk_id for c in now.chunks]
    return {
        "retrieval_enabled": True,
        "snapshot_epoch": body.snapshot_epoch,
        "current_epoch": now_epoch,
        "retrieval_unchanged": then_ids == now_ids,
        "retrieved_now": [c.citation() for c in now.chunks],
        "sources": sources,
    }


def source_drift(
    session: Session, tenant_id: str, source_id: str, version: int,
    cited: list[memory.CitedChunk], epoch: int
) -> dict[str, Any]:
    latest = session.scalar(
        select(SourceVersion)
        .where(SourceVersion.tenant_id == tenant_id, SourceVersion.source_id == source_id)
        .order_by(SourceVersion.version.desc())
        .limit(1)
    )
    entry: dict[str, Any] = {"source_id": source_id, "cited_version": version}
    if latest is None:
        return {**entry, "status": "missing"}
    entry["latest_version"] = latest.version
    if latest.valid_to_epoch <= epoch:
        return {**entry, "status": latest.status}  # deprecated or deleted: the source is closed
    if latest.version == version:
        return {**entry, "status": "unchanged"}
    current_texts = list(
        session.scalars(
            select(Chunk.text)
            .where(
                Chunk.tenant_id == tenant_id,
                Chunk.source_id == source_id,
                Chunk.version == latest.version,
            )
            .order_by(Chunk.ordinal)
        )
    )
    diffs = []
    for c in cited:
        if c.source_id != source_id or c.version != version:
            continue
        old = session.get(Chunk, c.chunk_id)
        if old is None:
            continue
        closest = max(
            current_texts,
            key=lambda t: difflib.SequenceMatcher(None, old.text, t).ratio(),
            default="",
        )
        if closest == old.text:
            continue
        diffs.append(
            {
                "chunk_id": old.id,
                "diff": "".join(
                    difflib.unified_diff(
                        old.text.splitlines(keepends=True),
                        closest.splitlines(keepends=True),
                        fromfile=f"{source_id}@v{version}",
                        tofile=f"{source_id}@v{latest.version}",
                    )
                ),
            }
        )
    return {**entry, "status": "changed", "chunk_diffs": diffs}
