"""Office files through their own libraries (python-docx, python-pptx, openpyxl) and CSV.

Word: paragraphs and tables in body order, "Heading N" styles as headings. PowerPoint: one
section per slide, headed "Slide N: <title>", its notes kept; ``slide_starts`` on the version.
Spreadsheets and CSV: each row one paragraph of ``header: value`` pairs, so a chunk cut
anywhere still says what each value is; one section per sheet (``sheet_starts``).
These files are zips: the registry checks them like any archive before the library opens them.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Sequence
from typing import Any

from ingest.loaders.base import Extracted, Rejected
from ingest.loaders.structure import heading, sections
from ingest.loaders.text import decode


def load_docx(data: bytes) -> Extracted:
    import docx
    from docx.table import Table
    from docx.text.paragraph import Paragraph

    document = docx.Document(io.BytesIO(data))
    title = (document.core_properties.title or "").strip()
    blocks: list[str] = []
    for item in document.iter_inner_content():
        if isinstance(item, Table):
            blocks.extend(_table_rows(_cell_texts(row.cells) for row in item.rows))
        elif isinstance(item, Paragraph) and item.text.strip():
            style = item.style.name if item.style is not None else ""
            level = _heading_level(style)
            if style == "Title":
                title = title or item.text.strip()
                blocks.append(heading(1, item.text))
            elif level:
                blocks.append(heading(level, item.text))
            else:
                blocks.append(item.text)
    return Extracted("\n\n".join(blocks), title)


def _heading_level(style: str) -> int:
    name, _, number = style.partition(" ")
    return int(number) if name == "Heading" and number.isdigit() else 0


def _cell_texts(cells: Iterable[Any]) -> list[str]:
    return [" ".join(cell.text.split()) for cell in cells]


def load_pptx(data: bytes) -> Extracted:
    from pptx import Presentation

    deck = Presentation(io.BytesIO(data))
    title = (deck.core_properties.title or "").strip()
    slides: list[str] = []
    for number, slide in enumerate(deck.slides, start=1):
        slide_title = ""
        if slide.shapes.title is not None and slide.shapes.title.has_text_frame:
            slide_title = slide.shapes.title.text_frame.text.strip()
        title = title or slide_title
        blocks = [heading(2, f"Slide {number}: {slide_title}" if slide_title else f"Slide {number}")]
        for shape in slide.shapes:
            if shape == slide.shapes.title:
                continue
            if shape.has_text_frame:
                blocks += [p for p in shape.text_frame.text.split("\n") if p.strip()]
            if getattr(shape, "has_table", False) and shape.has_table:
                blocks += _table_rows(_cell_texts(row.cells) for row in shape.table.rows)
        if slide.has_notes_slide and slide.notes_slide.notes_text_frame is not None:
            notes = slide.notes_slide.notes_text_frame.text.strip()
            if notes:
                blocks.append(f"Notes: {notes}")
        slides.append("\n\n".join(blocks))
    text, starts = sections(slides)
    return Extracted(text, title, {"slide_starts": starts} if starts else {})


def load_xlsx(data: bytes) -> Extracted:
    from openpyxl import load_workbook

    # read_only streams the rows; data_only gives cached formula results, not the formulas.
    workbook = load_workbook(io.BytesIO(data), read_only=True, data_only=True)
    try:
        title = (workbook.properties.title or "").strip()
        sheets = [
            "\n\n".join(
                [heading(2, f"Sheet: {sheet.title}"), *_table_rows(_row_texts(sheet.iter_rows(values_only=True)))]
            )
            for sheet in workbook.worksheets
        ]
    finally:
        workbook.close()
    text, starts = sections(sheets)
    return Extracted(text, title, {"sheet_starts": starts} if starts else {})


def _row_texts(rows: Iterable[Sequence[Any]]) -> Iterable[list[str]]:
    for row in rows:
        yield ["" if value is None else str(value).strip() for value in row]


def load_csv(data: bytes) -> Extracted:
    text, decision = decode(data)
    try:
        dialect: Any = csv.Sniffer().sniff(text[:8192], delimiters=",;\t|")
    except csv.Error:
        dialect = csv.excel
    try:
        rows = list(csv.reader(io.StringIO(text, newline=""), dialect))
    except csv.Error as error:
        raise Rejected(f"corrupt CSV: {error}") from error
    return Extracted("\n\n".join(_table_rows(rows)), "", decision)


def _table_rows(rows: Iterable[Sequence[str]]) -> list[str]:
    """One paragraph per row after the first non-empty one (the headers): ``header: value``
    pairs joined by ``; ``, empty cells left out, a column without a header named by its
    number."""
    headers: list[str] | None = None
    paragraphs: list[str] = []
    for row in rows:
        cells = [" ".join(str(c).split()) for c in row]
        if not any(cells):
            continue
        if headers is None:
            headers = cells
            continue
        pairs = [
            f"{headers[i] if i < len(headers) and headers[i] else f'column {i + 1}'}: {value}"
            for i, value in enumerate(cells)
            if value
        ]
        paragraphs.append("; ".join(pairs))
    if headers is not None and not paragraphs:
        paragraphs.append("; ".join(h for h in headers if h))  # a header-only table
    return paragraphs
