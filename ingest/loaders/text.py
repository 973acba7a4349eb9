"""Text in any charset, and the text formats: plain text, Markdown, HTML, reStructuredText.

UTF-8 (or UTF-16/32 with a BOM) is taken as it is. Anything else is decoded with the charset an
HTML page declares, or else the one charset-normalizer detects, and the decision is returned as
metadata that goes on the version (``charset``, ``charset_from``, and ``bytes_blake3``: the
BLAKE3 of the original bytes, so the version names exactly what was decoded). The version's
content hash stays the hash of the normalized text: decoding the same bytes always decides the
same way, so re-ingesting them is still a no-op.
"""

from __future__ import annotations

import codecs
import re
from typing import Any

from ingest.loaders.base import Extracted, Rejected
from provenance.hashing import blake3_hex

_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF8, "utf-8-sig"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)
# <meta charset=...>, <meta http-equiv=... content="...; charset=...">, <?xml encoding=...?>,
# looked for where the HTML standard's prescan looks: the first 1024 bytes.
_DECLARED_CHARSET = re.compile(
    rb"""<meta[^>]+charset\s*=\s*["']?\s*([A-Za-z0-9._:-]+)|<\?xml[^>]+encoding\s*=\s*["']([A-Za-z0-9._:-]+)""",
    re.IGNORECASE,
)
_NO_BOM_NO_UTF = ["utf_16", "utf_16_be", "utf_16_le", "utf_32", "utf_32_be", "utf_32_le", "utf_7"]
_MULTI_BYTE = [
    "big5", "big5hkscs", "cp932", "cp949", "cp950", "euc_jis_2004", "euc_jisx0213", "euc_jp",
    "euc_kr", "gb18030", "gb2312", "gbk", "hz", "iso2022_jp", "iso2022_kr", "johab",
    "shift_jis", "shift_jis_2004", "shift_jisx0213",
]  # fmt: skip
_HIGH_BYTES = [bytes([b]) for b in range(0x80, 0x100)]
# Among the guesses that fit about as well as the best, the charsets most text is written in.
_PREFERRED = ("cp1252", "iso8859_15", "latin_1", "cp932", "euc_jp", "gb18030", "big5", "euc_kr")
# Browsers read these labels as windows-1252 (WHATWG Encoding), and so do the pages' authors.
_WINDOWS_1252_LABELS = {"latin_1", "ascii", "iso8859_1"}


def decode(data: bytes, declared: str = "") -> tuple[str, dict[str, Any]]:
    """(text, metadata of the decision). ``declared`` is a charset the format itself names;
    a BOM overrides it, as in browsers."""
    try:
        return decode_unicode(data), {}
    except _NotUtf8 as error:
        utf8_error = error.error
    if declared:
        text = _declared(data, declared)
        if text is not None:
            return text[0], _decision(data, text[1], "declared")
    detected = _detect(data)
    if detected is None:
        raise Rejected(f"not valid UTF-8 text (byte {utf8_error.start}) and no charset fits it")
    return detected[0], _decision(data, detected[1], "detected")


def _detect(data: bytes) -> tuple[str, str] | None:
    """charset-normalizer's best guess; among guesses it rates the same, the charsets most
    text in the wild is written in (a short Western text fits a dozen code pages equally)."""
    from charset_normalizer import from_bytes

    # UTF-16/32 only with a BOM (taken above): without one, they "fit" any even-length bytes.
    excluded = list(_NO_BOM_NO_UTF)
    # Mostly ASCII with a few high bytes (an English changelog thanking "Fran\xe7ois") is a
    # single-byte charset; a CJK codec would pair each high byte with the letter after it.
    if sum(map(data.count, _HIGH_BYTES)) < 0.05 * len(data):
        excluded += _MULTI_BYTE
    matches = from_bytes(data, cp_exclusion=excluded)
    best = matches.best()
    if best is None:
        return None
    close = [
        m
        for m in matches
        if m.chaos <= best.chaos + 0.05 and m.coherence >= best.coherence - 0.1
    ]
    for preferred in _PREFERRED:
        for match in close:
            if preferred in match.could_be_from_charset:
                return data.decode(preferred), preferred
    return str(best), best.encoding


class _NotUtf8(Rejected):
    def __init__(self, error: UnicodeDecodeError) -> None:
        super().__init__(f"not valid UTF-8 text (byte {error.start})")
        self.error = error


def decode_unicode(data: bytes) -> str:
    """UTF-8, or the UTF the BOM names; nothing else (the JSON formats are UTF by definition)."""
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            return _strict(data, encoding)
    if b"\x00" in data:
        raise Rejected("contains NUL characters: binary data, not text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise _NotUtf8(error) from error


def _strict(data: bytes, encoding: str) -> str:
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as error:
        name = encoding.removesuffix("-sig").upper()
        raise Rejected(f"not valid {name} text (byte {error.start})") from error


def _declared(data: bytes, label: str) -> tuple[str, str] | None:
    """The text in the declared charset, or None when the label is unknown or does not fit."""
    try:
        name = codecs.lookup(label).name
    except LookupError:
        return None
    candidates = ["cp1252", name] if name.replace("-", "_") in _WINDOWS_1252_LABELS else [name]
    for candidate in candidates:
        try:
            return data.decode(candidate), candidate
        except UnicodeDecodeError:
            continue
    return None


def _decision(data: bytes, charset: str, how: str) -> dict[str, Any]:
    return {"charset": charset, "charset_from": how, "bytes_blake3": blake3_hex(data)}


def declared_charset(data: bytes) -> str:
    match = _DECLARED_CHARSET.search(data[:1024])
    if match is None:
        return ""
    return (match.group(1) or match.group(2)).decode("ascii")


def load_text(data: bytes) -> Extracted:
    text, decision = decode(data)
    return Extracted(text, "", decision)


def load_markdown(data: bytes) -> Extracted:
    text, decision = decode(data)
    return Extracted(text, markdown_title(text), decision)


def markdown_title(text: str) -> str:
    for line in text.splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return ""


# ---------------------------------------------------------------------------------------------
# HTML
# ---------------------------------------------------------------------------------------------

BOILERPLATE_TAGS = "script,style,noscript,template,nav,header,footer,aside,form,iframe,svg"
BLOCK_TAGS = (
    "p,div,section,article,main,h1,h2,h3,h4,h5,h6,li,ul,ol,dl,dt,dd,table,tr,blockquote,"
    "pre,figure,figcaption,hr,address,details,summary"
)
# Private-use characters mark breaks while HTML whitespace is collapsed.
_PARAGRAPH_MARK = "\ue000"
_LINE_MARK = "\ue001"


def load_html(data: bytes) -> Extracted:
    text, decision = decode(data, declared_charset(data))
    title, body = html_to_text(text)
    return Extracted(body, title, decision)


def html_to_text(html: str) -> tuple[str, str]:
    """Visible text of an HTML page: boilerplate elements dropped, one paragraph per block
    element, ``<br>`` and ``<pre>`` line breaks kept, other whitespace collapsed as a browser
    would."""
    from selectolax.lexbor import LexborHTMLParser

    tree = LexborHTMLParser(html.replace(_PARAGRAPH_MARK, " ").replace(_LINE_MARK, " "))
    title_node = tree.css_first("title")
    title = " ".join(title_node.text().split()) if title_node is not None else ""
    root = tree.body or tree.root
    if root is None:
        return title, ""
    for node in root.css(BOILERPLATE_TAGS):
        node.decompose()
    for node in root.css("pre"):
        node.replace_with(node.text().replace("\n", _LINE_MARK))
    for node in root.css("br"):
        node.replace_with(_LINE_MARK)
    for node in root.css(BLOCK_TAGS):
        node.insert_before(_PARAGRAPH_MARK)
        node.insert_after(_PARAGRAPH_MARK)
    text = " ".join(root.text(separator="").split())
    text = text.replace(_LINE_MARK, "\n").replace(_PARAGRAPH_MARK, "\n\n")
    return title, text


# ---------------------------------------------------------------------------------------------
# reStructuredText
# ---------------------------------------------------------------------------------------------

# Never read other files (``.. include::``) or pass raw markup through, never stop on a
# markup error: a document is data here, not a build.
_DOCUTILS_SETTINGS = {
    "file_insertion_enabled": False,
    "raw_enabled": False,
    "report_level": 5,
    "halt_level": 5,
    "warning_stream": False,
    "input_encoding": "unicode",
}


def load_rst(data: bytes) -> Extracted:
    """Parsed by docutils; sections become Markdown-style headings (``#`` per level), so the
    headings stay in the chunks; body elements become paragraphs, markup and comments go."""
    from docutils import nodes
    from docutils.core import publish_doctree

    text, decision = decode(data)
    tree = publish_doctree(text, settings_overrides=_DOCUTILS_SETTINGS)
    title = tree.get("title", "")
    blocks = [f"# {title}"] if title else []
    _rst_blocks(tree, 2 if title else 1, blocks, nodes)
    if not blocks and ".. include::" in text:
        raise Rejected("empty document: it only includes other files, which are never read")
    return Extracted("\n\n".join(blocks), title, decision)


def _rst_blocks(node: Any, depth: int, out: list[str], nodes: Any) -> None:
    skipped = (
        nodes.title,  # a section's title is written as its heading
        nodes.comment,
        nodes.system_message,
        nodes.substitution_definition,
        nodes.target,
        nodes.raw,
        nodes.pending,
        nodes.decoration,
    )
    for child in node.children:
        if isinstance(child, nodes.section):
            heading = child.next_node(nodes.title)
            if heading is not None:
                out.append(f"{'#' * min(depth, 6)} {heading.astext()}")
            _rst_blocks(child, depth + 1, out, nodes)
        elif isinstance(child, skipped):
            continue
        elif isinstance(child, nodes.TextElement | nodes.Text):
            out.append(child.astext())
        elif isinstance(child, nodes.Element):
            _rst_blocks(child, depth, out, nodes)
