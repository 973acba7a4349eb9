"""2 MB pages for the large buffers every decode step reads: the KV cache and the weights as the
kernels stream them.

With 4 KB pages a stream over hundreds of megabytes walks the page tables every 4 KB, and the
hardware prefetchers stop at each page's end. Linux backs memory with 2 MB pages (transparent
huge pages) where a region is advised so and its "enabled" setting is "madvise" or "always";
advice is only advice: where the OS declines, the buffers work as before on 4 KB pages.
"""

from __future__ import annotations

import contextlib
import math
import mmap
from collections.abc import Sequence

import torch

HUGE_PAGE = 2 << 20
_ALIGN = 64  # each tensor of a shared buffer starts on a cache line


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros that the OS may move onto 2 MB pages, advised once zeroed.

    Decode attention reads scattered blocks: with 4 KB pages nearly every block costs TLB
    misses. Measured, 64 decodes over a bf16 cache of 20 MB per layer on 2 cores: 2.17 ms per
    layer on 4 KB pages, 1.99 ms on 2 MB pages. Advised before its first touch, a buffer's page
    faults wait for the kernel to compact memory into huge pages (2.9 s for a 1.5 GB cache on a
    Zen 3 machine, 5-9 s seen when memory is fragmented, against 0.4 s; 2.65 s against 0.52 s for
    the bundled model's 2.1 GB on the Zen 4 kind), at every start. Advised after, the start is as
    fast as plain zeros and khugepaged moves the cache onto huge pages in the background, slowly:
    at its default pace (4,096 pages every 10 s) 28 MB of that 2.1 GB in the first 20 s.
    Faulted in on 2 MB pages at once (MADV_POPULATE_WRITE), the cache made decode attention 15 %
    faster and the engine 1-4.5 % on 2 Xeon cores with AMX, for 3-4 s more at every start
    (docs/architecture.md).
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    region, start = _mapping(nbytes)
    out = _view(region, start, nbytes, dtype, shape).zero_()
    _advise(region, start, nbytes)
    return out


def copies(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of ``tensors`` in one fresh buffer on 2 MB pages, advised before it is
    written, so its page faults take huge pages at once.

    For weights, which every decode step streams whole: on 2 Zen 4 cores (AMD EPYC family 25
    model 17) a batch-1 decode of the bundled model in bf16 (269 MB of packed weights) took
    8.9-10.0 ms against 11.3-11.7 on 4 KB pages (medians of 6 decodes, three alternations of a
    process each); building the model took 0.5 s longer, compaction included.
    """
    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets = [0]
    for size in sizes[:-1]:
        offsets.append(offsets[-1] + (size + _ALIGN - 1) // _ALIGN * _ALIGN)
    total = offsets[-1] + sizes[-1] if tensors else 0
    if total < HUGE_PAGE:
        return [t.contiguous().clone() for t in tensors]
    region, start = _mapping(total)
    _advise(region, start, total)
    out = []
    for t, offset, size in zip(tensors, offsets, sizes, strict=True):
        if size == 0:
            out.append(t.clone())
            continue
        out.append(_view(region, start + offset, size, t.dtype, tuple(t.shape)).copy_(t))
    return out


def _mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """A fresh private anonymous mapping (never-touched pages, unlike a reused heap block; shared
    ones are shmem, which transparent huge pages leave alone by default) holding
    ``nbytes`` from a 2 MB boundary, and that boundary's offset in it."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr()
    return region, -address % HUGE_PAGE


def _view(region: mmap.mmap, start: int, nbytes: int, dtype: torch.dtype,
          shape: tuple[int, ...]) -> torch.Tensor:
    # The tensor holds the mapping: it is unmapped with the last view of it.
    raw = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=start)
    return raw.view(dtype).view(shape)


def _advise(region: mmap.mmap, start: int, nbytes: int) -> None:
    whole = nbytes // HUGE_PAGE * HUGE_PAGE
    if whole and hasattr(mmap, "MADV_HUGEPAGE"):
        # A kernel without transparent huge pages refuses: 4 KB pages, as before.
        with contextlib.suppress(OSError):
            region.madvise(mmap.MADV_HUGEPAGE, start, whole)
