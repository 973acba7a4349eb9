"""The format loaders, on small files the tests write with each format's own library: structure
kept for citations, compressed files and archives read through, bombs and hostile input failed
per file, text in any charset."""

import bz2
import gzip
import io
import json
import lzma
import mailbox
import tarfile
import time
import zipfile
import zlib
from email.message import EmailMessage

import pytest
from blake3 import blake3

from ingest.chunking import normalize_text
from ingest.loaders import Limits, load_path

MB = 1 << 20
GB = 1 << 30


def only_document(result):
    assert (result.failures, result.skipped) == ([], [])
    [document] = result.documents
    return document


def only_failure(result):
    assert (result.documents, result.skipped) == ([], [])
    [failure] = result.failures
    return failure


def paragraphs(document):
    return normalize_text(document.text).split("\n\n")


def part_at(starts, text, needle):
    """Which part (1-based) of a document the offset of ``needle`` falls in."""
    offset = text.index(needle)
    return sum(1 for s in starts if s <= offset)


# ---------------------------------------------------------------------------------------------
# Formats
# ---------------------------------------------------------------------------------------------


def test_restructuredtext_keeps_headings_as_structure_and_reads_no_other_file(tmp_path):
    (tmp_path / "guide.rst").write_text(
        "==========\nLlama care\n==========\n\nIntro about *llamas*.\n\n"
        "Feeding\n=======\n\nGive hay daily.\n\n.. include:: /etc/passwd\n\n"
        "Water\n-----\n\n- Fresh water\n- Clean troughs\n\n::\n\n   troughs --clean\n\n"
        ".. note:: Mind the heat.\n\n.. a comment\n"
    )
    document = only_document(load_path(tmp_path / "guide.rst"))
    assert (document.kind, document.title) == ("rst", "Llama care")
    assert paragraphs(document) == [
        "# Llama care",
        "Intro about llamas.",
        "## Feeding",
        "Give hay daily.",
        "### Water",
        "Fresh water",
        "Clean troughs",
        "troughs --clean",
        "Mind the heat.",
    ]
    assert "root" not in document.text
    (tmp_path / "CONTRIBUTING.rst").write_text(".. include:: ../../CONTRIBUTING.rst\n")
    assert only_failure(load_path(tmp_path / "CONTRIBUTING.rst")).reason == (
        "empty document: it only includes other files, which are never read"
    )


def test_word_documents_keep_headings_and_tables(tmp_path):
    import docx

    doc = docx.Document()
    doc.core_properties.title = "Herd handbook"
    doc.add_heading("Shearing", level=1)
    doc.add_paragraph("Shear once a year.")
    doc.add_heading("Tools", level=2)
    table = doc.add_table(rows=3, cols=2)
    rows = [("tool", "use"), ("clippers", "fleece"), ("file", "")]
    for row, cells in zip(table.rows, rows, strict=True):
        for cell, value in zip(row.cells, cells, strict=True):
            cell.text = value
    doc.add_paragraph("After the table.")
    doc.save(tmp_path / "handbook.docx")
    document = only_document(load_path(tmp_path / "handbook.docx"))
    assert (document.kind, document.title) == ("docx", "Herd handbook")
    assert paragraphs(document) == [
        "# Shearing",
        "Shear once a year.",
        "## Tools",
        "tool: clippers; use: fleece",
        "tool: file",
        "After the table.",
    ]


def test_powerpoint_slides_are_numbered_sections_with_their_notes(tmp_path):
    from pptx import Presentation

    deck = Presentation()
    for number, (title, body) in enumerate([("Welcome", "Hello herd"), ("Feeding", "Hay")], 1):
        slide = deck.slides.add_slide(deck.slide_layouts[1])
        slide.shapes.title.text = title
        slide.placeholders[1].text = body
        slide.notes_slide.notes_text_frame.text = f"Say it {number} times"
    deck.save(tmp_path / "deck.pptx")
    document = only_document(load_path(tmp_path / "deck.pptx"))
    assert (document.kind, document.title) == ("pptx", "Welcome")
    text = normalize_text(document.text)
    assert text.split("\n\n") == [
        "## Slide 1: Welcome",
        "Hello herd",
        "Notes: Say it 1 times",
        "## Slide 2: Feeding",
        "Hay",
        "Notes: Say it 2 times",
    ]
    starts = document.metadata["slide_starts"]
    assert part_at(starts, text, "Hay") == 2 and part_at(starts, text, "Hello herd") == 1


def test_spreadsheet_rows_are_paragraphs_of_header_value_pairs(tmp_path):
    from openpyxl import Workbook

    workbook = Workbook()
    herd = workbook.active
    herd.title = "Herd"
    for row in [["name", "age", None], ["Dolly", 4, "calm"], ["Tina", None, None], []]:
        herd.append(row)
    feed = workbook.create_sheet("Feed")
    feed.append(["item", "kg"])
    feed.append(["hay", "=2+3"])
    workbook.save(tmp_path / "herd.xlsx")
    document = only_document(load_path(tmp_path / "herd.xlsx"))
    text = normalize_text(document.text)
    assert text.split("\n\n") == [
        "## Sheet: Herd",
        "name: Dolly; age: 4; column 3: calm",
        "name: Tina",
        "## Sheet: Feed",
        "item: hay",  # a formula Excel never computed has no cached value: nothing to show
    ]
    assert part_at(document.metadata["sheet_starts"], text, "item: hay") == 2


def test_csv_rows_carry_their_headers_in_any_delimiter_and_charset(tmp_path):
    (tmp_path / "herd.csv").write_text('name,notes\nDolly,"calm, friendly"\n\nTina,\n')
    (tmp_path / "herd.tsv").write_bytes("name;ville\nDolly;Besançon\n".encode("latin-1"))
    assert paragraphs(only_document(load_path(tmp_path / "herd.csv"))) == [
        "name: Dolly; notes: calm, friendly",
        "name: Tina",
    ]
    semicolons = only_document(load_path(tmp_path / "herd.tsv"))
    assert paragraphs(semicolons) == ["name: Dolly; ville: Besançon"]
    assert semicolons.metadata["charset_from"] == "detected"


def test_notebooks_keep_markdown_and_code_and_drop_outputs(tmp_path):
    notebook = {
        "nbformat": 4,
        "nbformat_minor": 5,
        "metadata": {"language_info": {"name": "python"}},
        "cells": [
            {"cell_type": "markdown", "metadata": {}, "source": ["# Herd analysis\n", "Counts."]},
            {
                "cell_type": "code",
                "metadata": {},
                "execution_count": 1,
                "source": "print(len(herd))",
                "outputs": [{"output_type": "stream", "name": "stdout", "text": ["SECRET 42\n"]}],
            },
            {"cell_type": "raw", "metadata": {}, "source": "raw cell"},
        ],
    }
    (tmp_path / "analysis.ipynb").write_text(json.dumps(notebook))
    document = only_document(load_path(tmp_path / "analysis.ipynb"))
    assert (document.kind, document.title) == ("notebook", "Herd analysis")
    assert paragraphs(document) == ["# Herd analysis\nCounts.", "```python\nprint(len(herd))\n```"]
    (tmp_path / "broken.ipynb").write_text('{"cells": 3}')
    assert only_failure(load_path(tmp_path / "broken.ipynb")).reason == (
        "corrupt notebook: no list of cells (nbformat 4 expected)"
    )


def test_epub_chapters_in_reading_order(tmp_path):
    from ebooklib import epub

    book = epub.EpubBook()
    book.set_identifier("llama-book")
    book.set_title("The llama book")
    book.set_language("en")
    chapters = []
    for number, body in [(1, "Llamas hum."), (2, "Alpacas spit.")]:
        chapter = epub.EpubHtml(title=f"Chapter {number}", file_name=f"c{number}.xhtml")
        chapter.content = f"<h1>Chapter {number}</h1><p>{body}</p>"
        book.add_item(chapter)
        chapters.append(chapter)
    book.add_item(epub.EpubNcx())
    book.add_item(epub.EpubNav())
    book.spine = [chapters[1], chapters[0]]  # the spine, not the file order, is reading order
    epub.write_epub(str(tmp_path / "book.epub"), book)
    document = only_document(load_path(tmp_path / "book.epub"))
    assert (document.kind, document.title) == ("epub", "The llama book")
    text = normalize_text(document.text)
    assert text.split("\n\n") == ["Chapter 2", "Alpacas spit.", "Chapter 1", "Llamas hum."]
    assert part_at(document.metadata["chapter_starts"], text, "Llamas hum.") == 2


def message(subject, body, html=False):
    mail = EmailMessage()
    mail["From"], mail["To"], mail["Subject"] = "vet@farm.example", "herd@farm.example", subject
    mail["Date"] = "Mon, 30 Nov 2026 10:00:00 +0000"
    if html:
        mail.set_content(f"<html><body><p>{body}</p></body></html>", subtype="html")
    else:
        mail.set_content(body)
    mail.add_attachment(b"\x89PNG attachment", maintype="image", subtype="png", filename="x.png")
    return mail


def test_email_messages_and_mailboxes(tmp_path):
    (tmp_path / "visit.eml").write_bytes(bytes(message("Vet visit", "Teeth checked: fine.")))
    document = only_document(load_path(tmp_path / "visit.eml"))
    assert (document.kind, document.title) == ("email", "Vet visit")
    assert paragraphs(document) == [
        "From: vet@farm.example\nTo: herd@farm.example\nDate: Mon, 30 Nov 2026 10:00:00 +0000\n"
        "Subject: Vet visit",
        "Teeth checked: fine.",
    ]
    box = mailbox.mbox(tmp_path / "herd.mbox")
    box.add(message("First", "From the start: hay."))  # "From " in a body is escaped
    box.add(message("Second", "Shearing <b>tomorrow</b>.", html=True))
    box.close()
    result = load_path(tmp_path / "herd.mbox", prefix="mail/")
    assert (result.failures, result.skipped) == ([], [])
    assert [(d.source_id, d.title, paragraphs(d)[-1]) for d in result.documents] == [
        ("mail/herd.mbox/1", "First", ">From the start: hay."),
        ("mail/herd.mbox/2", "Second", "Shearing tomorrow."),
    ]


# ---------------------------------------------------------------------------------------------
# Compressed files and archives
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("suffix", "compress"), [(".gz", gzip.compress), (".bz2", bz2.compress), (".xz", lzma.compress)]
)
def test_a_compressed_file_is_the_file_inside_it(tmp_path, suffix, compress):
    (tmp_path / f"changelog.Debian{suffix}").write_bytes(compress(b"llama (1.0) stable; urgency=low"))
    (tmp_path / f"notes.md{suffix}").write_bytes(compress(b"# Notes\n\nHay."))
    result = load_path(tmp_path)
    assert (result.failures, result.skipped) == ([], [])
    assert [(d.source_id, d.kind, d.title) for d in result.documents] == [
        (f"changelog.Debian{suffix}", "text", ""),
        (f"notes.md{suffix}", "markdown", "Notes"),
    ]


def write_zip(path, members, compression=zipfile.ZIP_DEFLATED):
    with zipfile.ZipFile(path, "w", compression) as archive:
        for name, data in members.items():
            archive.writestr(name, data)


def test_archive_members_are_sources_named_archive_slash_member(tmp_path):
    inner = io.BytesIO()
    write_zip(inner, {"deep.txt": "Nested member."})
    members = {
        "docs/care.md": "# Care\n\nHay daily.",
        "docs/.hidden.txt": "skipped like a hidden file",
        "img/logo.png": b"\x89PNG",
        "bad.pdf": b"%PDF-1.4 nonsense",
        "inner.zip": inner.getvalue(),
    }
    write_zip(tmp_path / "kb.zip", members)
    with tarfile.open(tmp_path / "kb.tar.gz", "w:gz") as archive:
        for name, data in [("./docs/care.md", b"# Care\n\nHay daily."), ("img/logo.png", b"\x89")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    result = load_path(tmp_path, prefix="kb/")
    assert [(d.source_id, d.kind, d.title) for d in result.documents] == [
        ("kb/kb.tar.gz/docs/care.md", "markdown", "Care"),
        ("kb/kb.zip/docs/care.md", "markdown", "Care"),
        ("kb/kb.zip/inner.zip/deep.txt", "text", ""),
    ]
    assert result.documents[1].uri == (tmp_path / "kb.zip").resolve().as_uri() + "#docs/care.md"
    assert [(f.source_id, f.reason[:11]) for f in result.failures] == [
        ("kb/kb.zip/bad.pdf", "corrupt PDF")
    ]
    assert [s.source_id for s in result.skipped] == [
        "kb/kb.tar.gz/img/logo.png",
        "kb/kb.zip/img/logo.png",
    ]


def test_a_zip_bomb_fails_that_file_from_its_declared_sizes(tmp_path):
    write_zip(tmp_path / "bomb.zip", {f"{n}.txt": b"\0" * (40 * MB) for n in range(3)})
    (tmp_path / "fine.txt").write_text("Fine.")
    started = time.perf_counter()
    result = load_path(tmp_path)
    assert time.perf_counter() - started < 5  # refused before inflating 120 MB
    assert [d.source_id for d in result.documents] == ["fine.txt"]
    [failure] = result.failures
    assert failure.source_id == "bomb.zip"
    assert failure.reason.startswith("decompression bomb: members declare 125829120 bytes from ")


def test_a_zip_that_lies_about_its_sizes_still_stops_at_the_limit(tmp_path):
    write_zip(tmp_path / "liar.zip", {"a.txt": b"a" * (2 * MB)}, zipfile.ZIP_STORED)
    data = bytearray((tmp_path / "liar.zip").read_bytes())
    size = (2 * MB).to_bytes(4, "little")
    data[:] = data.replace(size, (10).to_bytes(4, "little"))  # both headers declare 10 bytes
    (tmp_path / "liar.zip").write_bytes(data)
    failure = only_failure(load_path(tmp_path / "liar.zip"))
    # zipfile never yields more than a member declares: the lie costs 10 bytes, then a CRC error.
    assert failure.source_id == "liar.zip/a.txt"
    assert failure.reason == "corrupt archive member: Bad CRC-32 for file 'a.txt'"


def test_too_many_members_and_too_large_members(tmp_path):
    write_zip(tmp_path / "many.zip", {f"{n}.txt": f"file {n}" for n in range(11)})
    limits = Limits(max_members=10, max_file_bytes=1000)
    failure = only_failure(load_path(tmp_path / "many.zip", limits=Limits(max_members=10)))
    assert failure.reason == "archive has more than 10 members"
    write_zip(tmp_path / "big.zip", {"big.txt": "x" * 1001, "small.txt": "small"})
    result = load_path(tmp_path / "big.zip", limits=limits)
    assert [d.source_id for d in result.documents] == ["big.zip/small.txt"]
    assert [(f.source_id, f.reason) for f in result.failures] == [
        ("big.zip/big.txt", "expands to 1001 bytes, over the 1000-byte limit")
    ]


def gzip_bomb(expanded_mb: int) -> bytes:
    """``expanded_mb`` MB of zeros as concatenated gzip members (a valid gzip file), built
    without ever holding the expansion."""
    member = gzip.compress(b"\0" * MB, compresslevel=9)
    return member * expanded_mb


def test_a_gzip_bomb_fails_that_file_after_bounded_work(tmp_path):
    (tmp_path / "bomb.txt.gz").write_bytes(gzip_bomb(4096))  # 4 GB from about 4 MB
    (tmp_path / "fine.txt").write_text("Fine.")
    started = time.perf_counter()
    result = load_path(tmp_path)
    assert time.perf_counter() - started < 10  # stopped at the 20 MB file limit
    assert [d.source_id for d in result.documents] == ["fine.txt"]
    [failure] = result.failures
    assert (failure.source_id, failure.reason) == (
        "bomb.txt.gz",
        f"expands past the {20 * MB}-byte file limit",
    )
    # With room for large files, the ratio limit stops it: 64 MB from 65 kB.
    (tmp_path / "ratio.txt.gz").write_bytes(bomb := gzip_bomb(64))
    failure = only_failure(load_path(tmp_path / "ratio.txt.gz", limits=Limits(max_file_bytes=GB)))
    assert failure.reason == f"decompression bomb: expands more than 200 times its {len(bomb)} bytes"


def test_a_tar_bomb_is_charged_for_the_members_it_skips(tmp_path):
    """A member too large to load is still streamed past: the budget counts it."""
    with tarfile.open(tmp_path / "bomb.tar.gz", "w:gz", compresslevel=9) as archive:
        info = tarfile.TarInfo("zeros.txt")
        info.size = 64 * MB
        archive.addfile(info, io.BytesIO(bytes(info.size)))
    limits = Limits(max_file_bytes=MB, max_expanded_bytes=16 * MB, max_ratio=10_000)
    failure = only_failure(load_path(tmp_path / "bomb.tar.gz", limits=limits))
    assert (failure.source_id, failure.reason) == (
        "bomb.tar.gz",
        f"decompression bomb: expands past the {16 * MB}-byte limit",
    )


def test_a_bomb_inside_an_archive_fails_the_archive_and_nesting_is_bounded(tmp_path):
    inner = io.BytesIO()
    write_zip(inner, {"zeros.txt": b"\0" * (8 * MB)})
    write_zip(tmp_path / "outer.zip", {"ok.txt": "fine", "inner.zip": inner.getvalue()})
    failure = only_failure(load_path(tmp_path / "outer.zip"))
    assert failure.source_id == "outer.zip" and failure.reason.startswith("decompression bomb")
    nested = b"deepest"
    for depth in range(4):
        buffer = io.BytesIO()
        write_zip(buffer, {f"level{depth}.zip" if depth else "deep.txt": nested})
        nested = buffer.getvalue()
    (tmp_path / "russian.zip").write_bytes(nested)
    failure = only_failure(load_path(tmp_path / "russian.zip"))
    assert failure.reason == "archives nested more than 3 deep"


def test_office_files_are_checked_as_zips_before_their_library_opens_them(tmp_path):
    write_zip(tmp_path / "bomb.docx", {"word/document.xml": b" " * (64 * MB)})
    failure = only_failure(load_path(tmp_path / "bomb.docx"))
    assert failure.reason.startswith("decompression bomb: members declare")
    (tmp_path / "broken.xlsx").write_bytes(b"PK\x03\x04 not really")
    assert only_failure(load_path(tmp_path / "broken.xlsx")).reason.startswith("corrupt zip archive")


# ---------------------------------------------------------------------------------------------
# Charsets
# ---------------------------------------------------------------------------------------------


def test_a_latin1_html_page_is_read_in_its_declared_charset(tmp_path):
    page = (
        '<html><head><meta http-equiv="Content-Type" content="text/html; charset=ISO-8859-1">'
        "<title>Caf\xe9 des lamas</title></head><body><p>Cr\xe8me br\xfbl\xe9e \x96 "
        "d\xe9j\xe0 servie.</p></body></html>"
    )
    data = page.encode("latin-1")
    (tmp_path / "cafe.html").write_bytes(data)
    document = only_document(load_path(tmp_path / "cafe.html"))
    assert document.title == "Café des lamas"
    # Browsers read ISO-8859-1 as windows-1252: 0x96 is an en dash there.
    assert normalize_text(document.text) == "Crème brûlée – déjà servie."
    assert dict(document.metadata) == {
        "charset": "cp1252",
        "charset_from": "declared",
        "bytes_blake3": blake3(data).hexdigest(),
    }


def test_a_shift_jis_text_file_is_decoded_by_detection(tmp_path):
    text = "ラマの世話について。毎日干し草と新鮮な水を与えてください。毛刈りは年に一度、春に行います。"
    data = text.encode("shift_jis")
    (tmp_path / "care.txt").write_bytes(data)
    document = only_document(load_path(tmp_path / "care.txt"))
    assert document.text == text
    assert document.metadata["charset"] in {"cp932", "shift_jis", "shift_jis_2004"}
    assert document.metadata["charset_from"] == "detected"
    assert document.metadata["bytes_blake3"] == blake3(data).hexdigest()
    # UTF-8 needs no decision: nothing is recorded.
    (tmp_path / "care-utf8.txt").write_text(text)
    assert only_document(load_path(tmp_path / "care-utf8.txt")).metadata == {}


def test_a_wrong_declaration_falls_back_to_detection(tmp_path):
    (tmp_path / "mislabeled.html").write_bytes(
        '<meta charset="utf-8"><p>Ce caf\xe9 est tr\xe8s bon, merci beaucoup.</p>'.encode("latin-1")
    )
    document = only_document(load_path(tmp_path / "mislabeled.html"))
    assert normalize_text(document.text) == "Ce café est très bon, merci beaucoup."
    assert document.metadata["charset_from"] == "detected"


# ---------------------------------------------------------------------------------------------
# Hostile input fails one source
# ---------------------------------------------------------------------------------------------


def test_a_pdf_decompression_bomb_fails_that_file(tmp_path):
    from pypdf import PdfWriter
    from pypdf.generic import NameObject, StreamObject

    writer = PdfWriter()
    page = writer.add_blank_page(100, 100)
    contents = StreamObject()
    contents._data = zlib.compress(b" " * (80 * 1000 * 1000), 9)  # past pypdf's 75 MB cap
    contents[NameObject("/Filter")] = NameObject("/FlateDecode")
    page[NameObject("/Contents")] = writer._add_object(contents)
    with (tmp_path / "bomb.pdf").open("wb") as out:
        writer.write(out)
    failure = only_failure(load_path(tmp_path / "bomb.pdf"))
    assert failure.reason.startswith("PDF decompression bomb: Limit reached while decompressing")


def test_json_lines_with_lone_surrogates_and_nul_fail_only_their_line(tmp_path):
    lines = [
        r'{"id": "ok", "text": "Fine line.", "metadata": {"title": "A\u0000B"}}',
        r'{"id": "bad-text", "text": "broken \ud800 text"}',
        r'{"id": "bad\udc00id", "text": "text"}',
        r'{"id": "nul\u0000id", "text": "text"}',
        r'{"id": "bad-meta", "text": "text", "metadata": {"k": "\udfff"}}',
        r'{"id": "nul-text", "text": "NUL\u0000 inside"}',
    ]
    (tmp_path / "mixed.jsonl").write_text("\n".join(lines))
    result = load_path(tmp_path / "mixed.jsonl")
    assert [(d.source_id, d.title) for d in result.documents] == [("ok", "A B"), ("nul-text", "")]
    assert {f.source_id: f.reason for f in result.failures} == {
        "bad-text": "text is not valid Unicode (a lone surrogate at character 7)",
        "mixed.jsonl#3": "line 3: 'id' is not valid Unicode (a lone surrogate at character 3)",
        "mixed.jsonl#4": "line 4: 'id' contains a NUL character",
        "bad-meta": "metadata is not valid Unicode",
    }


def test_a_file_name_that_is_not_utf8_gets_an_escaped_id(tmp_path):
    import os

    name = os.fsdecode(b"caf\xe9.txt")
    (tmp_path / name).write_text("Coffee.")
    document = only_document(load_path(tmp_path))
    assert document.source_id == "caf\\xe9.txt"


def test_a_50_mb_single_line_json_lines_file_fails_alone(tmp_path):
    with (tmp_path / "huge.jsonl").open("w") as out:
        out.write('{"id": "huge", "text": "')
        out.write("llama " * (50 * MB // 6))
        out.write('"}')
    (tmp_path / "huge.jsonl.gz").write_bytes(gzip.compress((tmp_path / "huge.jsonl").read_bytes(), 1))
    (tmp_path / "small.jsonl").write_text('{"id": "small", "text": "Small."}')
    result = load_path(tmp_path)
    assert [d.source_id for d in result.documents] == ["small"]
    assert {f.source_id: f.reason for f in result.failures} == {
        "huge.jsonl": f"file is {(tmp_path / 'huge.jsonl').stat().st_size} bytes, over the "
        f"{20 * MB}-byte limit",
        "huge.jsonl.gz": f"expands past the {20 * MB}-byte file limit",
    }


def test_a_library_crash_fails_only_that_file(tmp_path, monkeypatch):
    from ingest.loaders import office, registry

    def explode(data):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setitem(registry.LOADERS, ".csv", registry.single("csv", explode))
    (tmp_path / "a.csv").write_text("x\n1\n")
    (tmp_path / "b.txt").write_text("Fine.")
    result = load_path(tmp_path)
    assert [d.source_id for d in result.documents] == ["b.txt"]
    assert [(f.source_id, f.reason) for f in result.failures] == [
        ("a.csv", "cannot read .csv file: RecursionError: maximum recursion depth exceeded")
    ]
    assert office.load_csv  # the real loader is untouched


@pytest.mark.parametrize(("name", "mode"), [("kb.tar", "w"), ("kb.tbz2", "w:bz2"), ("kb.tar.xz", "w:xz")])
def test_every_tar_flavour_is_read_through(tmp_path, name, mode):
    with tarfile.open(tmp_path / name, mode) as archive:
        data = b"Shear once a year."
        info = tarfile.TarInfo("guide.txt")
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))
    document = only_document(load_path(tmp_path / name))
    assert (document.source_id, document.text) == (f"{name}/guide.txt", "Shear once a year.")
