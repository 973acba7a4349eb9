"""E-mail: a message (.eml) is one source; a mailbox (.mbox) is one source per message, named
``<mbox id>/<n>`` (1-based, in file order: an mbox only grows at its end). The text is the
From/To/Date/Subject header lines and the plain-text body (else the HTML body as text);
attachments are left out."""

from __future__ import annotations

import re
from email import policy
from email.message import EmailMessage
from email.parser import BytesParser

from ingest.loaders.base import Blob, Document, Extracted, LoadFailure, LoadResult
from ingest.loaders.text import html_to_text

_HEADERS = ("From", "To", "Cc", "Date", "Subject")
# Where a message starts in an mbox: a "From " line at the start of the file or of a line
# (lines of the body that begin so are escaped as ">From " by every mbox writer).
_MBOX_FROM = re.compile(rb"^From ", re.MULTILINE)


def load_eml(data: bytes) -> Extracted:
    message = BytesParser(policy=policy.default).parsebytes(data)
    assert isinstance(message, EmailMessage)  # the default policy's message class
    lines = [f"{name}: {message[name]}" for name in _HEADERS if message[name]]
    body = message.get_body(preferencelist=("plain", "html"))
    text = ""
    if body is not None:
        content = body.get_content()
        text = html_to_text(content)[1] if body.get_content_type() == "text/html" else content
    return Extracted("\n".join(lines) + "\n\n" + text, str(message["Subject"] or "").strip())


def load_mbox(blob: Blob) -> LoadResult:
    starts = [m.start() for m in _MBOX_FROM.finditer(blob.data)]
    ends = [*starts[1:], len(blob.data)]
    result = LoadResult()
    for number, (start, end) in enumerate(zip(starts, ends, strict=True), start=1):
        source_id, uri = f"{blob.source_id}/{number}", f"{blob.uri}#{number}"
        raw = blob.data[start:end]
        try:
            message = load_eml(raw.partition(b"\n")[2])  # past the "From " separator line
        except Exception as error:  # one malformed message fails alone
            result.failures.append(LoadFailure(source_id, uri, f"corrupt message: {error}"))
            continue
        result.documents.append(
            Document(source_id, message.text, uri, "email", message.title, message.metadata)
        )
    if not starts:
        result.failures.append(LoadFailure(blob.source_id, blob.uri, "no messages in mbox file"))
    return result
