"""A receipt's body is serialized in two parts, the request's while the engine runs and the
answer's after it: joined, they must be the bytes the whole body serializes to, since the audit
log hashes them."""

from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from provenance.hashing import canonical_json, canonical_members, join_members
from provenance.memory import CitedChunk
from provenance.receipts import Operation, ReceiptBody, ReceiptRecord, ReceiptStatus

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@given(st.dictionaries(st.text(), json_values, max_size=8), st.data())
def test_members_join_into_the_canonical_json_of_the_union(obj, data):
    keys = sorted(obj)
    split = data.draw(st.integers(0, len(keys)))
    first = {key: obj[key] for key in keys[:split]}
    second = {key: obj[key] for key in keys[split:]}
    joined = join_members(canonical_members(second), canonical_members(first))
    assert joined.encode() == canonical_json(obj)


def chunk(rank: int) -> CitedChunk:
    return CitedChunk(rank=rank, score=0.5 + rank / 3, chunk_id=f"c{rank}", chunk_hash=f"{rank:064x}",
                      source_id=f"doc-{rank}.md", version=rank, ordinal=rank, title="Prix \u00e9t\u00e9 \u2028",
                      char_start=rank * 10, char_end=rank * 10 + 9)


def record(**overrides) -> ReceiptRecord:
    fields = dict(
        receipt_id="rcpt_0123456789abcdef01234567", tenant_id="acme", api_key_id="key_1",
        model_id="smollm2", weights_hash="a" * 64,
        messages=[{"role": "user", "content": 'Why "this"? \u00e9\u4e2d'}],
        sampling={"temperature": 0.7, "top_p": 0.9, "seed": None, "stop": ["\n\n"],
                  "logit_bias": {"13": -1.5}},
        engine={"dtype": "float32", "block_size": 16, "batch_invariant": True},
        retrieval={"query": "why", "snapshot_epoch": 7, "embedding_model": "minilm",
                   "chunks": [chunk(1), chunk(2)]},
        prompt_text="<|im_start|>system ...", prompt_token_count=321,
        template_version="inherent-rag-v1",
        created_at=datetime(2026, 12, 6, 9, 30, 1, 250, tzinfo=timezone(timedelta(hours=-5))),
        request_id="req-1",
    )
    return ReceiptRecord(**{**fields, **overrides})


def answered(rec: ReceiptRecord, error: dict | None = None) -> ReceiptRecord:
    """Fill in the answer as the API does, after the request part was serialized."""
    rec.serialize_request()
    rec.output_text += "Because \u2713"
    rec.output_token_ids.extend([17, 4, 99])
    rec.finish_reason = "stop" if error is None else "abort"
    rec.timeline = {"ttft": 0.125, "itl": [0.03125, 1 / 3], "kv_transfer": None,
                    "prefill_chunks": [{"start": 0.0, "end": 0.1, "tokens": 321}]}
    rec.error = error
    return rec


@pytest.mark.parametrize(
    "rec",
    [
        answered(record()),
        answered(record(), {"type": "cancelled", "message": "the client went away mid-answer"}),
        answered(record(retrieval=None, api_key_id=None, request_id=None),
                 {"type": "generation_failed", "message": "the engine failed"}),
        answered(record(messages=[], operation=Operation.text_completion, retrieval=None,
                        completion_prompt=[1, 2, 3], template_version="none")),
        answered(record(messages=[], operation=Operation.text_completion, retrieval=None,
                        completion_prompt="Once upon", template_version="none")),
        record(),  # never answered: the request part serialized at write time
    ],
    ids=["ok", "cancelled", "failed", "token-prompt", "text-prompt", "unanswered"],
)
def test_the_joined_body_is_the_whole_body_serialized(rec):
    row = rec.row()
    body = ReceiptBody.model_validate_json(row.body)
    assert canonical_json({**body.stored_request(), **body.stored_answer()}).decode() == row.body
    assert body.status == rec.status == row.status
    assert body.output_text == rec.output_text
    assert body.output_token_ids == rec.output_token_ids
    assert body.timeline == rec.timeline
    assert body.finish_reasons == ([rec.finish_reason] if rec.finish_reason else [])
    assert body.chunks == (rec.retrieval or {}).get("chunks", [])
    assert body.prompt == rec.completion_prompt
    assert body.request_id == rec.request_id
    assert (row.prompt_hash, row.output_hash) == (body.prompt_hash, body.output_hash)


def test_the_answer_part_follows_the_record_after_the_request_part_is_serialized():
    rec = record()
    first = rec.row()
    assert ReceiptBody.model_validate_json(first.body).status == ReceiptStatus.ok
    rec.output_text = "late"
    rec.error = {"type": "cancelled", "message": "gone"}
    later = ReceiptBody.model_validate_json(rec.row().body)
    assert (later.output_text, later.status, later.error_type) == ("late", "cancelled", "cancelled")
    assert later.stored_request() == ReceiptBody.model_validate_json(first.body).stored_request()
