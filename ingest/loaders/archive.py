"""Compressed files (.gz, .bz2, .xz) and archives (.zip, .tar and compressed tars), read through.

A compressed single file is the file inside it: same source id, the loader of its inner name.
An archive's members are sources of their own, named ``<archive id>/<member path>``. Nothing is
ever decompressed whole before it is measured: every read is a bounded stream, and what one
top-level file expands to is charged to its ``Budget`` (total bytes, ratio to the stored size),
so a bomb fails that file, with the reason, after at most the limit's worth of work. A member
over ``max_file_bytes`` fails alone; the members' count is capped too.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import posixpath
import tarfile
import zipfile
import zlib
from collections.abc import Callable
from typing import BinaryIO

from ingest.loaders.base import RATIO_FLOOR_BYTES, Blob, LoadFailure, LoadResult, Rejected

Dispatch = Callable[[Blob], LoadResult]

_READ = 1 << 20
OPENERS: dict[str, Callable[[BinaryIO], BinaryIO]] = {
    ".gz": lambda f: gzip.GzipFile(fileobj=f),
    ".bz2": bz2.BZ2File,
    ".xz": lzma.LZMAFile,
}
TARS = {".tar": "", ".tar.gz": ".gz", ".tgz": ".gz", ".tar.bz2": ".bz2", ".tbz2": ".bz2",
        ".tbz": ".bz2", ".tar.xz": ".xz", ".txz": ".xz"}  # fmt: skip
_STREAM_ERRORS = (OSError, EOFError, zlib.error, lzma.LZMAError, ValueError)


class Bomb(Rejected):
    """The top-level file's budget is spent: the whole file fails, not one member."""


class MemberTooLarge(Rejected):
    pass


def load_compressed(blob: Blob, suffix: str, dispatch: Dispatch) -> LoadResult:
    """``name.ext.gz`` is ``name.ext``, under the compressed file's own source id."""
    _check_depth(blob)
    with OPENERS[suffix](io.BytesIO(blob.data)) as stream:
        data = _read_capped(stream, blob, suffix, spend=True)
    inner = blob.name[: -len(suffix)]
    return dispatch(_inner(blob, data, inner, blob.source_id, blob.uri))


def load_zip(blob: Blob, dispatch: Dispatch) -> LoadResult:
    _check_depth(blob)
    archive = open_zip(blob)
    result = LoadResult()
    for info in sorted(archive.infolist(), key=lambda i: i.filename):
        name = _member_name(info.filename)
        if info.is_dir() or name is None:
            continue
        member = _member(blob, name)
        try:
            if info.flag_bits & 0x1:
                raise Rejected("encrypted archive member")
            if info.file_size > blob.budget.limits.max_file_bytes:
                raise MemberTooLarge(_too_large(info.file_size, blob))
            with archive.open(info) as stream:
                data = _read_capped(stream, blob, "zip member", spend=True)
        except Bomb:
            raise
        except (Rejected, zipfile.BadZipFile, NotImplementedError, *_STREAM_ERRORS) as error:
            result.failures.append(LoadFailure(member.source_id, member.uri, _reason(error)))
            continue
        result.extend(dispatch(_inner(blob, data, name, member.source_id, member.uri)))
    return result


def load_tar(blob: Blob, suffix: str, dispatch: Dispatch) -> LoadResult:
    """Streamed in one pass (``r|``): the decompressed stream is charged as it is read, the
    data of members that are skipped over included."""
    _check_depth(blob)
    compression = TARS[suffix]
    raw: BinaryIO = io.BytesIO(blob.data)
    if compression:
        raw = OPENERS[compression](raw)
    result = LoadResult()
    members = 0
    try:
        with tarfile.open(fileobj=_Charged(raw, blob), mode="r|") as archive:
            for info in archive:
                name = _member_name(info.name)
                if not info.isfile() or name is None:
                    continue
                members += 1
                _check_count(members, blob)
                member = _member(blob, name)
                if info.size > blob.budget.limits.max_file_bytes:
                    result.failures.append(
                        LoadFailure(member.source_id, member.uri, _too_large(info.size, blob))
                    )
                    continue
                stream = archive.extractfile(info)
                data = _read_capped(stream, blob, "tar member", spend=False) if stream else b""
                result.extend(dispatch(_inner(blob, data, name, member.source_id, member.uri)))
    except (tarfile.TarError, *_STREAM_ERRORS) as error:
        raise Rejected(f"corrupt tar archive: {error}") from error
    return result


def open_zip(blob: Blob) -> zipfile.ZipFile:
    """The zip, its member count and declared sizes checked before anything is inflated (a
    member's stream never yields more than its declared size, so this bounds the work; Office
    files and EPUBs are zips and go through here too)."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(blob.data))
    except (zipfile.BadZipFile, *_STREAM_ERRORS) as error:
        raise Rejected(f"corrupt zip archive: {error}") from error
    infos = archive.infolist()
    _check_count(len(infos), blob)
    limits = blob.budget.limits
    declared = sum(i.file_size for i in infos)
    # What the members declare, checked against the same limits as what they yield.
    if declared > limits.max_expanded_bytes or not _ratio_ok(declared, blob):
        raise Bomb(
            f"decompression bomb: members declare {declared} bytes from {len(blob.data)} "
            f"(limits: {limits.max_expanded_bytes} bytes, ratio {limits.max_ratio:g})"
        )
    return archive


def check_zip(blob: Blob) -> None:
    open_zip(blob).close()


def _ratio_ok(expanded: int, blob: Blob) -> bool:
    return expanded <= RATIO_FLOOR_BYTES or expanded <= blob.budget.limits.max_ratio * len(blob.data)


class _Charged(io.RawIOBase):
    """A read-only stream that charges what it yields to the blob's budget."""

    def __init__(self, stream: BinaryIO, blob: Blob) -> None:
        self._stream, self._blob = stream, blob

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        if size < 0:
            return self.readall()
        data = self._stream.read(size)
        _spend(self._blob, len(data))
        return data


def _read_capped(stream: BinaryIO, blob: Blob, what: str, *, spend: bool) -> bytes:
    """At most ``max_file_bytes`` from a stream, read in bounded steps."""
    cap = blob.budget.limits.max_file_bytes
    parts: list[bytes] = []
    total = 0
    try:
        while chunk := stream.read(min(_READ, cap + 1 - total)):
            total += len(chunk)
            if spend:
                _spend(blob, len(chunk))
            if total > cap:
                raise MemberTooLarge(f"expands past the {cap}-byte file limit")
            parts.append(chunk)
    except _STREAM_ERRORS as error:
        raise Rejected(f"corrupt {what.lstrip('.')} data: {error}") from error
    return b"".join(parts)


def _spend(blob: Blob, n: int) -> None:
    try:
        blob.budget.spend(n)
    except Rejected as error:
        raise Bomb(str(error)) from None


def _too_large(size: int, blob: Blob) -> str:
    return f"expands to {size} bytes, over the {blob.budget.limits.max_file_bytes}-byte limit"


def _check_depth(blob: Blob) -> None:
    if blob.depth >= blob.budget.limits.max_depth:
        raise Rejected(f"archives nested more than {blob.budget.limits.max_depth} deep")


def _check_count(members: int, blob: Blob) -> None:
    if members > blob.budget.limits.max_members:
        raise Bomb(f"archive has more than {blob.budget.limits.max_members} members")


def _member_name(path: str) -> str | None:
    """The member's path as its source id ends, or None for hidden entries (as a folder walk
    skips them) and names that resolve to nothing."""
    name = posixpath.normpath(path.replace("\\", "/")).lstrip("/")
    parts = name.split("/")
    if name in ("", ".") or any(p.startswith(".") for p in parts):
        return None
    return name


def _member(blob: Blob, name: str) -> Blob:
    separator = "/" if "#" in blob.uri else "#"
    return _inner(blob, b"", name, f"{blob.source_id}/{name}", f"{blob.uri}{separator}{name}")


def _inner(blob: Blob, data: bytes, name: str, source_id: str, uri: str) -> Blob:
    return Blob(data, name, source_id, uri, blob.id_prefix, blob.budget, blob.depth + 1)


def _reason(error: BaseException) -> str:
    if isinstance(error, Rejected):
        return str(error)
    return f"corrupt archive member: {error}"
