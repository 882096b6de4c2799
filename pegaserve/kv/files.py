"""KV cache files in shared memory: an engine process keeps its cache (and its blocks'
generations) in one, and the decode side of a same-node handoff maps the prefill engine's."""

from __future__ import annotations

import mmap
import os
import warnings
from collections import OrderedDict

import torch

from pegaserve.cpu import pages

_GENERATIONS_ALIGN = 4096  # the blocks start on a page of their own


def map_kv_file(path: str, shape: tuple[int, ...], dtype: torch.dtype, create: bool = False,
                with_blocks: bool = True, populate: bool = True) -> tuple[torch.Tensor | None, memoryview]:
    """A KV cache file in shared memory: the blocks as a tensor (`with_blocks`; with `populate`
    every page faulted in now, or the handoff would pay a page fault per 4 KB it touches) and their generations
    (`BlockPool.generations`, int64 each). `create` makes it, zeroed; otherwise a missing file
    raises FileNotFoundError (never a fresh file of zeros taken for someone's KV)."""
    num_blocks = shape[2]
    generation_bytes = -(-8 * num_blocks // _GENERATIONS_ALIGN) * _GENERATIONS_ALIGN
    numel = 1
    for n in shape:
        numel *= n
    num_bytes = generation_bytes + (numel * dtype.itemsize if with_blocks else 0)
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    try:
        if create:
            os.ftruncate(fd, num_bytes)
        mapping = mmap.mmap(fd, num_bytes, mmap.MAP_SHARED)
    finally:
        os.close(fd)
    generations = memoryview(mapping)[: 8 * num_blocks].cast("q")
    if not with_blocks:
        return None, generations
    with warnings.catch_warnings():  # a writable mapping: torch's "non-writable buffer" warning does not apply
        warnings.simplefilter("ignore", UserWarning)
        cache = torch.frombuffer(mapping, dtype=dtype, offset=generation_bytes).view(shape)
    if populate:
        pages.populate(cache)
    return cache, generations


class MappedKvFiles:
    """Other engines' cache files, each mapped once and kept; past `max_files` the least recently
    used is unmapped (one file per prefill engine of the node)."""

    def __init__(self, max_files: int = 8, populate: bool = True) -> None:
        self.max_files = max_files
        self.populate = populate
        self._files: OrderedDict[str, tuple[torch.Tensor, memoryview]] = OrderedDict()

    def get(self, path: str, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, memoryview]:
        """The file's blocks and generations (`map_kv_file`'s errors when it cannot be mapped)."""
        mapped = self._files.pop(path, None)
        if mapped is None:
            mapped = map_kv_file(path, shape, dtype, populate=self.populate)
            while len(self._files) >= self.max_files:
                self._files.popitem(last=False)
        self._files[path] = mapped
        return mapped

    def __len__(self) -> int:
        return len(self._files)
