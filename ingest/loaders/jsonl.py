"""JSON lines (.jsonl, .ndjson): one ``{"id", "text", "metadata"}`` source per line. A line
without an id is named ``<file id>#<line number>``; a bad line fails alone."""

from __future__ import annotations

import json

from ingest.loaders.base import Blob, Document, LoadFailure, LoadResult
from ingest.loaders.text import decode_unicode
from ingest.loaders.validate import storable_problem


def load_jsonl(blob: Blob) -> LoadResult:
    result = LoadResult()
    text = decode_unicode(blob.data)
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        fallback_id = f"{blob.source_id}#{number}"
        line_uri = f"{blob.uri}#L{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            result.failures.append(
                LoadFailure(fallback_id, line_uri, f"line {number}: invalid JSON ({error.msg})")
            )
            continue
        except RecursionError:
            result.failures.append(
                LoadFailure(fallback_id, line_uri, f"line {number}: JSON nested too deeply")
            )
            continue
        if not isinstance(record, dict):
            result.failures.append(
                LoadFailure(fallback_id, line_uri, f"line {number}: not a JSON object")
            )
            continue
        raw_id = record.get("id", fallback_id)
        id_ok = isinstance(raw_id, str | int) and not isinstance(raw_id, bool) and str(raw_id) != ""
        id_problem = storable_problem(str(raw_id)) if id_ok else "must be a non-empty string"
        id_ok = not id_problem
        # A line with a usable id fails under that id, so a full cleanup keeps its source.
        source_id = (
            (blob.id_prefix + str(raw_id) if "id" in record else raw_id) if id_ok else fallback_id
        )
        metadata = record.get("metadata") or {}
        body = record.get("text")
        if not id_ok:
            problem = f"'id' {id_problem}"
        elif not isinstance(body, str):
            problem = "'text' must be a string"
        elif not isinstance(metadata, dict):
            problem = "'metadata' must be an object"
        else:
            problem = ""
        if problem:
            result.failures.append(LoadFailure(source_id, line_uri, f"line {number}: {problem}"))
            continue
        title = str(metadata.get("title", ""))
        result.documents.append(Document(source_id, body, line_uri, "jsonl", title, metadata))
    if not result.documents and not result.failures:
        result.failures.append(
            LoadFailure(blob.source_id, blob.uri, "no records in JSON lines file")
        )
    return result
