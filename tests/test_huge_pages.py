"""Buffers on 2 MB pages: the same values as plain tensors, and huge pages where Linux grants them."""

import gc
from pathlib import Path

import pytest
import torch

from engine import huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_by_advice() -> bool:
    return THP.exists() and ("[madvise]" in THP.read_text() or "[always]" in THP.read_text())


def anon_huge_kb(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds ``address``."""
    mapping = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            mapping = start <= address < end
        elif mapping and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_copies_hold_the_same_tensors_contiguous_and_aligned():
    tensors = [torch.randn(700, 513).to(torch.bfloat16), torch.randint(0, 255, (3000, 97), dtype=torch.uint8),
               torch.randn(5, 7).t(), torch.empty(0, 4)]
    copies = huge_pages.copies(tensors)
    del tensors[2:]  # a transposed view: its copy is contiguous
    gc.collect()
    for original, copy in zip(tensors, copies[:2], strict=True):
        assert copy.dtype == original.dtype and copy.shape == original.shape
        assert torch.equal(copy, original) and copy.data_ptr() != original.data_ptr()
        assert copy.is_contiguous() and copy.data_ptr() % 64 == 0
    assert copies[2].is_contiguous() and copies[2].shape == (7, 5)
    assert copies[3].shape == (0, 4)
    copies[0].add_(1)  # writable, and the mapping outlives the function that made it
    assert torch.equal(copies[0], (tensors[0] + 1))


def test_small_copies_stay_plain():
    small = torch.arange(10.0)
    (copy,) = huge_pages.copies([small])
    assert torch.equal(copy, small) and copy.data_ptr() != small.data_ptr()


@pytest.mark.skipif(not thp_by_advice(), reason="transparent huge pages are off on this kernel")
def test_copies_take_huge_pages_at_once():
    weights = [torch.ones(3 << 20, dtype=torch.uint8), torch.ones(2 << 20, dtype=torch.uint8)]
    copies = huge_pages.copies(weights)
    assert anon_huge_kb(copies[0].data_ptr()) >= 2048


def test_zeros_are_zero():
    cache = huge_pages.zeros((64, 16, 2, 3, 64), torch.bfloat16)
    assert cache.shape == (64, 16, 2, 3, 64) and not cache.any()
    assert huge_pages.zeros((4, 4), torch.float32).eq(0).all()
