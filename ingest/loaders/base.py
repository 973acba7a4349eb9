"""The values every loader shares: what comes in (``Blob``), what goes out (``Document``,
``LoadFailure``, ``LoadResult``), the limits that bound the work, and ``Rejected``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from provenance.settings import Settings

DEFAULT_MAX_FILE_BYTES: int = Settings.model_fields["max_file_bytes"].default


@dataclass(frozen=True, slots=True)
class Document:
    """One source's extracted text (normalized later, by the pipeline) and where it came from."""

    source_id: str
    text: str
    uri: str
    kind: str
    title: str = ""
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class LoadFailure:
    """A source that did not load (failed) or that no loader handles (skipped), with why."""

    source_id: str
    uri: str
    reason: str


@dataclass(slots=True)
class LoadResult:
    documents: list[Document] = field(default_factory=list)
    failures: list[LoadFailure] = field(default_factory=list)
    # Unsupported types: present in the input (so never cleaned up) but neither loaded nor failed.
    skipped: list[LoadFailure] = field(default_factory=list)

    def extend(self, other: LoadResult) -> None:
        self.documents.extend(other.documents)
        self.failures.extend(other.failures)
        self.skipped.extend(other.skipped)


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds on the work one input file may cause. ``max_file_bytes`` caps a file as stored and
    every file or member after decompression; the archive limits cap everything one top-level
    file expands to (nested archives included), so a bomb fails that file and nothing else."""

    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    max_expanded_bytes: int = Settings.model_fields["archive_max_expanded_bytes"].default
    max_ratio: float = Settings.model_fields["archive_max_ratio"].default
    max_members: int = Settings.model_fields["archive_max_members"].default
    # Archives inside archives are read down to this depth (a zip of zips of zips is a bomb
    # shape; real corpora nest one or two levels).
    max_depth: int = 3

    @classmethod
    def of(cls, settings: Settings) -> Limits:
        return cls(
            max_file_bytes=settings.max_file_bytes,
            max_expanded_bytes=settings.archive_max_expanded_bytes,
            max_ratio=settings.archive_max_ratio,
            max_members=settings.archive_max_members,
        )


class Rejected(Exception):
    """A source-level problem; becomes a LoadFailure with this message as the reason."""


class Unsupported(Rejected):
    """No loader handles this source; it is reported as skipped, not failed."""


@dataclass(slots=True)
class Budget:
    """What one top-level file has expanded to so far, shared by its nested archives."""

    limits: Limits
    compressed: int  # the top-level file's size as stored
    expanded: int = 0

    def spend(self, n: int) -> None:
        self.expanded += n
        limits = self.limits
        if self.expanded > limits.max_expanded_bytes:
            raise Rejected(
                f"decompression bomb: expands past the {limits.max_expanded_bytes}-byte limit"
            )
        # Tiny files compress absurdly well without being dangerous: the ratio only counts
        # once the output is big enough to matter.
        ratio = self.expanded / max(self.compressed, 1)
        if self.expanded > RATIO_FLOOR_BYTES and ratio > limits.max_ratio:
            raise Rejected(
                f"decompression bomb: expands more than {limits.max_ratio:g} times its "
                f"{self.compressed} bytes"
            )


RATIO_FLOOR_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Blob:
    """One file's (or archive member's) bytes and the identity its documents take."""

    data: bytes
    name: str  # the file or member name; its suffix picks the loader
    source_id: str
    uri: str
    id_prefix: str  # prepended to ids a format carries itself (JSON lines)
    budget: Budget
    depth: int = 0  # how many archives this blob is inside

    def document(
        self, kind: str, text: str, title: str = "", metadata: Mapping[str, Any] | None = None
    ) -> Document:
        return Document(self.source_id, text, self.uri, kind, title, dict(metadata or {}))


@dataclass(frozen=True, slots=True)
class Extracted:
    """What a single-document loader found in a file."""

    text: str
    title: str = ""
    metadata: Mapping[str, Any] = field(default_factory=dict)
