"""Advice to Linux about the pages behind large CPU tensors (madvise; a no-op elsewhere, or where
the kernel refuses the advice)."""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable

import torch

_PAGE_BYTES = 4096
_HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23  # Linux 5.14+


def advise_huge_pages(tensor: torch.Tensor) -> None:
    """Back the tensor's whole 2 MB pages with huge pages when they are first touched.

    Through 4 KB pages a stream through a large weight runs ~15% slower (the hardware prefetcher
    stops at every page boundary), and a fresh 39 MB output takes ~9,500 page faults. Where
    transparent huge pages are off this does nothing.
    """
    _advise(tensor, _HUGE_PAGE_BYTES, _MADV_HUGEPAGE)


def populate(tensor: torch.Tensor) -> None:
    """Fault in every page of a mapped tensor now, writable, without changing its bytes: a process
    that maps another's KV cache would otherwise pay a page fault per 4 KB the first time each is
    read or written (~5 ms per 8 MB handoff instead of ~1)."""
    _advise(tensor, _PAGE_BYTES, _MADV_POPULATE_WRITE)


def _advise(tensor: torch.Tensor, page_bytes: int, advice: int) -> None:
    madvise = _madvise()
    if madvise is None:
        return
    start = tensor.data_ptr()
    first = -(-start // page_bytes) * page_bytes
    last = (start + tensor.nbytes) // page_bytes * page_bytes
    if last > first:
        madvise(first, last - first, advice)  # a refusal leaves the pages as they are


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise
