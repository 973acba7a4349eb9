"""Loaders: every supported format, folder walks, and bad input as per-source failures."""

import json

import pytest
from pypdf import PdfReader, PdfWriter
from reportlab.pdfgen import canvas

from ingest.chunking import normalize_text
from ingest.loaders import html_to_text, load_path, load_paths


def write_pdf(path, pages, title="Shearing guide"):
    pdf = canvas.Canvas(str(path))
    pdf.setTitle(title)
    for lines in pages:
        y = 800
        for line in lines:
            pdf.drawString(72, y, line)
            y -= 16
        pdf.showPage()
    pdf.save()


def only_document(result):
    assert result.failures == []
    [document] = result.documents
    return document


def only_failure(result):
    assert result.documents == []
    [failure] = result.failures
    return failure


def test_plain_text_and_markdown(tmp_path):
    (tmp_path / "notes.txt").write_text("Plain notes.\n\nSecond paragraph.")
    (tmp_path / "guide.md").write_text("Intro line\n\n# Llama care\n\nFeed hay daily.")
    text = only_document(load_path(tmp_path / "notes.txt"))
    assert (text.source_id, text.kind, text.title) == ("notes.txt", "text", "")
    assert text.text == "Plain notes.\n\nSecond paragraph."
    assert text.uri == (tmp_path / "notes.txt").resolve().as_uri()
    markdown = only_document(load_path(tmp_path / "guide.md", source_id="care"))
    assert (markdown.source_id, markdown.kind, markdown.title) == ("care", "markdown", "Llama care")
    assert "Feed hay daily." in markdown.text


def test_html_drops_boilerplate_and_keeps_block_structure():
    html = """<html><head><title> Llama   &amp; alpaca </title><style>p{color:red}</style>
    <script>track()</script></head><body>
    <header>Site header</header><nav><a href="/">Home</a> | <a href="/about">About</a></nav>
    <main><h1>Caring for llamas</h1>
    <p>Llamas need <b>fresh</b>
       water and <a href="#">hay</a>.</p>
    <div>First line<br>second line</div>
    <ul><li>Shear yearly</li><li>Trim hooves</li></ul>
    <pre>code  line 1
code line 2</pre></main>
    <aside>Related posts</aside><footer>(c) 2026 Farm</footer></body></html>"""
    title, text = html_to_text(html)
    text = normalize_text(text)
    assert title == "Llama & alpaca"
    assert text.split("\n\n") == [
        "Caring for llamas",
        "Llamas need fresh water and hay.",
        "First line\nsecond line",
        "Shear yearly",
        "Trim hooves",
        "code line 1\ncode line 2",
    ]
    for boilerplate in ["Site header", "Home", "Related posts", "(c) 2026", "track()", "color:red"]:
        assert boilerplate not in text


def test_html_file_loads_as_a_document(tmp_path):
    (tmp_path / "page.html").write_text(
        "<html><head><title>T</title></head><body><p>Body text.</p></body></html>"
    )
    document = only_document(load_path(tmp_path / "page.html"))
    assert (document.kind, document.title, normalize_text(document.text)) == (
        "html",
        "T",
        "Body text.",
    )


def test_json_lines_give_one_source_per_line(tmp_path):
    lines = [
        json.dumps(
            {
                "id": "faq-1",
                "text": "How often to shear?",
                "metadata": {"title": "Shearing", "lang": "en"},
            }
        ),
        "",
        json.dumps({"text": "No id given."}),
        "{not json",
        json.dumps(["a", "list"]),
        json.dumps({"id": "faq-2", "text": 42}),
        json.dumps({"id": "faq-3", "text": "   "}),
        json.dumps({"id": "faq-4", "text": "fine", "metadata": "not an object"}),
        json.dumps({"id": "", "text": "an empty id"}),
    ]
    (tmp_path / "faq.jsonl").write_text("\n".join(lines))
    result = load_path(tmp_path / "faq.jsonl", prefix="kb/")
    assert [(d.source_id, d.title, dict(d.metadata)) for d in result.documents] == [
        ("kb/faq-1", "Shearing", {"title": "Shearing", "lang": "en"}),
        ("kb/faq.jsonl#3", "", {}),
    ]
    assert result.documents[0].uri.endswith("faq.jsonl#L1")
    reasons = {f.source_id: f.reason for f in result.failures}
    assert reasons == {
        "kb/faq.jsonl#4": "line 4: invalid JSON (Expecting property name enclosed in double quotes)",
        "kb/faq.jsonl#5": "line 5: not a JSON object",
        "kb/faq-2": "line 6: 'text' must be a string",
        "kb/faq-3": "empty document",
        "kb/faq-4": "line 8: 'metadata' must be an object",
        "kb/faq.jsonl#9": "line 9: 'id' must be a non-empty string",
    }


def test_an_empty_json_lines_file_is_a_failure(tmp_path):
    (tmp_path / "none.jsonl").write_text("\n\n")
    assert (
        only_failure(load_path(tmp_path / "none.jsonl")).reason == "no records in JSON lines file"
    )


def test_pdf_text_and_title(tmp_path):
    write_pdf(
        tmp_path / "guide.pdf",
        [["Llamas are social animals.", "Keep at least two."], ["Page two text."]],
    )
    document = only_document(load_path(tmp_path / "guide.pdf"))
    assert (document.kind, document.title) == ("pdf", "Shearing guide")
    text = normalize_text(document.text)
    pages = text.split("\n\n")
    assert pages == ["Llamas are social animals.\nKeep at least two.", "Page two text."]
    # Where each page starts in the normalized text: a cited chunk's char_start finds its page.
    assert document.metadata["page_starts"] == [0, text.index("Page two")]


def test_corrupt_and_encrypted_pdfs_are_failures(tmp_path):
    (tmp_path / "broken.pdf").write_bytes(b"%PDF-1.7\nthis is not really a pdf")
    assert only_failure(load_path(tmp_path / "broken.pdf")).reason.startswith("corrupt PDF")
    write_pdf(tmp_path / "plain.pdf", [["secret text"]])
    writer = PdfWriter(clone_from=PdfReader(tmp_path / "plain.pdf"))
    writer.encrypt("password")
    with (tmp_path / "locked.pdf").open("wb") as out:
        writer.write(out)
    assert only_failure(load_path(tmp_path / "locked.pdf")).reason == "PDF is encrypted"


def test_a_pdf_without_text_is_an_empty_document(tmp_path):
    write_pdf(tmp_path / "scan.pdf", [[]])
    assert only_failure(load_path(tmp_path / "scan.pdf")).reason == "empty document"


@pytest.mark.parametrize(
    ("name", "content", "reason"),
    [
        ("binary.txt", b"abc\x00def", "contains NUL characters: binary data, not text"),
        ("blank.md", b" \n\t\n", "empty document"),
        (
            "cut.txt.gz",
            b"\x1f\x8b\x08\x00garbage",
            "corrupt gz data: Compressed file ended before the end-of-stream marker was reached",
        ),
    ],
)
def test_bad_input_is_a_failure_with_a_reason(tmp_path, name, content, reason):
    (tmp_path / name).write_bytes(content)
    failure = only_failure(load_path(tmp_path / name))
    assert (failure.source_id, failure.reason) == (name, reason)


@pytest.mark.parametrize(
    ("name", "content", "reason"),
    [
        ("image.png", b"\x89PNG", "unsupported file type '.png'"),
        ("data.bin", b"\x00\x01", "unsupported file type '.bin'"),
        (
            "program",
            b"\x7fELF\x00\x00",
            "unsupported file type '(no extension)' (contains NUL characters: binary data, not text)",
        ),
    ],
)
def test_unsupported_types_are_skipped_not_failed(tmp_path, name, content, reason):
    (tmp_path / name).write_bytes(content)
    result = load_path(tmp_path / name)
    assert (result.documents, result.failures) == ([], [])
    [skip] = result.skipped
    assert (skip.source_id, skip.reason) == (name, reason)


def test_files_named_by_convention_are_read_as_text(tmp_path):
    for name in ["README", "copyright", "changelog.Debian"]:
        (tmp_path / name).write_text(f"The {name} file.")
    result = load_path(tmp_path)
    assert [(d.source_id, d.kind, d.text) for d in result.documents] == [
        ("README", "text", "The README file."),
        ("changelog.Debian", "text", "The changelog.Debian file."),
        ("copyright", "text", "The copyright file."),
    ]


def test_utf16_with_a_bom_is_read(tmp_path):
    (tmp_path / "wide.txt").write_bytes("Ünïcode text".encode("utf-16"))
    assert only_document(load_path(tmp_path / "wide.txt")).text == "Ünïcode text"


def test_files_over_the_size_limit_are_not_read(tmp_path):
    (tmp_path / "big.txt").write_text("x" * 101)
    failure = only_failure(load_path(tmp_path / "big.txt", max_file_bytes=100))
    assert failure.reason == "file is 101 bytes, over the 100-byte limit"


def test_unreadable_files_are_failures(tmp_path):
    (tmp_path / "gone.txt").symlink_to(tmp_path / "missing-target.txt")
    assert only_failure(load_path(tmp_path / "gone.txt")).reason.startswith("cannot read file")


def test_a_folder_is_walked_recursively_in_sorted_order(tmp_path):
    root = tmp_path / "corpus"
    for relative in [
        "b.md",
        "a.txt",
        "sub/z.txt",
        "sub/deeper/c.md",
        "A.txt",
        ".hidden.txt",
        ".git/config.txt",
    ]:
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"content of {relative}")
    (root / "sub" / "data.jsonl").write_text(json.dumps({"id": "row", "text": "a row"}))
    (root / "sub" / "skip.bin").write_bytes(b"\x00")
    result = load_path(root, prefix="docs/")
    assert [d.source_id for d in result.documents] == [
        "docs/A.txt",
        "docs/a.txt",
        "docs/b.md",
        "docs/row",
        "docs/sub/deeper/c.md",
        "docs/sub/z.txt",
    ]
    assert result.failures == []
    assert [(f.source_id, f.reason) for f in result.skipped] == [
        ("docs/sub/skip.bin", "unsupported file type '.bin'")
    ]
    assert load_path(root, prefix="docs/") == result  # deterministic


def test_load_paths_concatenates_in_the_order_given(tmp_path):
    (tmp_path / "one.txt").write_text("one")
    (tmp_path / "two.txt").write_text("two")
    result = load_paths([tmp_path / "two.txt", tmp_path / "one.txt"])
    assert [d.source_id for d in result.documents] == ["two.txt", "one.txt"]
