"""One ingestion job over a folder of hostile and broken files next to good ones: every bad
file fails alone with its reason, unsupported types are skipped, the job succeeds and indexes
the rest; re-ingesting changes nothing. On SQLite, and on PostgreSQL (which refuses NUL
characters in text) as an integration test."""

import gzip
import io
import json
import zipfile
import zlib

import pytest
from pypdf import PdfReader, PdfWriter
from pypdf.generic import NameObject, StreamObject
from reportlab.pdfgen import canvas

from ingest import jobs
from provenance.migrate import upgrade
from provenance.settings import Settings
from provenance.vector_index import close_vector_indexes

MB = 1 << 20
GOOD = "Llamas are social herd animals and should never be kept alone."


def write_hostile_corpus(folder):
    folder.mkdir()
    (folder / "care.md").write_text(f"# Care\n\n{GOOD}")
    (folder / "cafe.html").write_bytes(
        b'<meta charset="iso-8859-1"><title>Caf\xe9</title><p>Le caf\xe9 des lamas.</p>'
    )
    (folder / "guide.rst").write_text("Guide\n=====\n\nShear the fleece once a year.\n")
    (folder / "logo.png").write_bytes(b"\x89PNG\r\n")
    # PDF: one locked, one whose content stream inflates past pypdf's 75 MB cap.
    pdf = io.BytesIO()
    page = canvas.Canvas(pdf)
    page.drawString(72, 720, "secret")
    page.save()
    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(pdf.getvalue())))
    writer.encrypt("password")
    with (folder / "locked.pdf").open("wb") as out:
        writer.write(out)
    writer = PdfWriter()
    blank = writer.add_blank_page(100, 100)
    contents = StreamObject()
    contents._data = zlib.compress(b" " * (80 * 1000 * 1000), 9)
    contents[NameObject("/Filter")] = NameObject("/FlateDecode")
    blank[NameObject("/Contents")] = writer._add_object(contents)
    with (folder / "bomb.pdf").open("wb") as out:
        writer.write(out)
    # JSON lines: a lone surrogate, NUL in an id, a title, a text and metadata.
    lines = [
        {"id": "faq-ok", "text": "Alpacas are smaller than llamas."},
        {"id": "faq-nul-title", "text": "Hay keeps them warm.", "metadata": {"title": "A\0B"}},
        {"id": "faq-nul-meta", "text": "Water daily.", "metadata": {"note": "x\0y"}},
        {"id": "faq-nul-text", "text": "Trim\0 toenails every few months."},
        {"id": "faq\0nul-id", "text": "never stored"},
    ]
    (folder / "faq.jsonl").write_text(
        "\n".join([*map(json.dumps, lines), r'{"id": "faq-surrogate", "text": "bad \ud800"}'])
    )
    with (folder / "huge.jsonl").open("w") as out:
        out.write('{"id": "huge", "text": "' + "llama " * (50 * MB // 6) + '"}')
    # Bombs: a zip that declares 120 MB of zeros, a gzip of 4 GB of zeros.
    with zipfile.ZipFile(folder / "bomb.zip", "w", zipfile.ZIP_DEFLATED) as archive:
        for n in range(3):
            archive.writestr(f"{n}.txt", bytes(40 * MB))
    (folder / "bomb.txt.gz").write_bytes(gzip.compress(bytes(MB), 9) * 4096)


EXPECTED_FAILED = {
    "locked.pdf": "PDF is encrypted",
    "bomb.pdf": "PDF decompression bomb",
    "faq.jsonl#5": "line 5: 'id' contains a NUL character",
    "faq-surrogate": "text is not valid Unicode",
    "huge.jsonl": "file is",
    "bomb.zip": "decompression bomb: members declare",
    "bomb.txt.gz": "expands past the",
}
EXPECTED_ADDED = [
    "cafe.html",
    "care.md",
    "faq-nul-meta",
    "faq-nul-text",
    "faq-nul-title",
    "faq-ok",
    "guide.rst",
]


def ingest_hostile_corpus(settings, folder):
    write_hostile_corpus(folder)
    status = jobs.get_job(settings, jobs.submit_ingestion(jobs.Runtime(settings), "acme", [folder], wait=True))
    assert status.state == "succeeded", status.summary
    assert {k: status.summary[k] for k in ("added", "failed", "skipped")} == {
        "added": len(EXPECTED_ADDED),
        "failed": len(EXPECTED_FAILED),
        "skipped": 1,
    }
    assert sorted(status.errors) == sorted(EXPECTED_FAILED)
    for source_id, reason in EXPECTED_FAILED.items():
        assert status.errors[source_id].startswith(reason), (source_id, status.errors[source_id])
    assert status.summary["skipped_sources"] == {"logo.png": "unsupported file type '.png'"}
    assert (status.total_sources, status.done_sources) == (15, 15)
    sources = {s.source_id: s.latest for s in jobs.list_sources(settings, "acme")}
    assert sorted(sources) == EXPECTED_ADDED
    assert sources["faq-nul-title"].title == "A B"
    assert sources["cafe.html"].title == "Café"
    assert sources["cafe.html"].metadata["charset"] == "cp1252"
    assert sources["faq-nul-meta"].metadata == {"note": "x\0y"}

    # The same bytes again: nothing changes, the charset decision included.
    again = jobs.get_job(settings, jobs.submit_ingestion(jobs.Runtime(settings), "acme", [folder], wait=True))
    assert (again.summary["added"], again.summary["updated"], again.summary["unchanged"]) == (
        0,
        0,
        len(EXPECTED_ADDED),
    )
    assert again.summary["epochs"] == []


@pytest.mark.slow
def test_every_bad_file_fails_alone_and_the_job_goes_on(tmp_path):
    settings = Settings(data_dir=tmp_path / "data", chunk_tokens=60, chunk_overlap=8)
    try:
        ingest_hostile_corpus(settings, tmp_path / "corpus")
    finally:
        close_vector_indexes()


@pytest.mark.slow
@pytest.mark.integration
def test_nul_characters_and_hostile_files_on_postgresql(pg_url, tmp_path):
    upgrade(pg_url)
    settings = Settings(
        data_dir=tmp_path / "data", database_url=pg_url, chunk_tokens=60, chunk_overlap=8
    )
    try:
        ingest_hostile_corpus(settings, tmp_path / "corpus")
    finally:
        close_vector_indexes()
