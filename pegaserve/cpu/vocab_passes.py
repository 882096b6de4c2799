"""The sampler's passes over rows of logits through the kernel `csrc/vocab_passes.cpp`:
one sweep per row each, where the torch versions in `pegaserve/sample/passes.py` and `filters.py`
chain several ops that each stream the row again (~4 ms against ~1 for a batch of 16 rows of 152k).

Each function answers None where the kernel cannot run (neither AVX-512 nor AVX2, no compiler): the sampler then
uses its torch path, which computes the same quantities (argmax exactly; masses and bounds within
float rounding). Rows are `row_ids` of `source` (None: all of them, in order); per-row arguments
are `[n, 1]` float32.
"""

from __future__ import annotations

import torch

from pegaserve.cpu import kernels


def _library():
    return kernels.vocab_passes()


def _ready(source: torch.Tensor) -> bool:
    return source.dtype == torch.float32 and source.device.type == "cpu" and source.dim() == 2


def _per_row(values: torch.Tensor | None) -> torch.Tensor | None:
    return None if values is None else values.to(torch.float32).contiguous()


def _ptr(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.data_ptr()


def max_argmax(source: torch.Tensor, row_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each row's max (`[n, 1]`) and the first index holding it (`[n]`, as `torch.argmax`)."""
    library = _library()
    if library is None or not _ready(source):
        return None
    source = source.contiguous()
    row_ids = None if row_ids is None else row_ids.to(torch.long).contiguous()
    n = source.shape[0] if row_ids is None else len(row_ids)
    maxima, argmax = torch.empty(n, 1), torch.empty(n, dtype=torch.long)
    library.pegaserve_max_argmax(source.data_ptr(), source.shape[1], source.shape[1], _ptr(row_ids), n,
                                 maxima.data_ptr(), argmax.data_ptr())
    return maxima, argmax


def cell_masses(source: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, row_ids: torch.Tensor | None,
                lower: torch.Tensor | None, floor: float, cell: int) -> torch.Tensor | None:
    """`[n, num_cells]`: per cell of `cell` columns, the sum of 2^max((logit - shift) * scale, floor),
    with logits below `lower` at the floor."""
    library = _library()
    if library is None or not _ready(source):
        return None
    source = source.contiguous()
    row_ids = None if row_ids is None else row_ids.to(torch.long).contiguous()
    shift, scale, lower = _per_row(shift), _per_row(scale), _per_row(lower)
    n, vocab = shift.shape[0], source.shape[1]
    masses = torch.empty(n, -(-vocab // cell))
    library.pegaserve_cell_masses(source.data_ptr(), vocab, vocab, _ptr(row_ids), n, shift.data_ptr(),
                                  scale.data_ptr(), _ptr(lower), floor, cell, masses.data_ptr())
    return masses


def top_p_bound(source: torch.Tensor, row_ids: torch.Tensor | None, shift: torch.Tensor, scale: torch.Tensor,
                lower: torch.Tensor | None, top_p: list[float], floor: float, num_buckets: int) -> torch.Tensor | None:
    """`[n, 1]`: the lowest logit top-p keeps (at or above `lower`; -inf or `lower` when it keeps all)."""
    library = _library()
    if library is None or not _ready(source):
        return None
    source = source.contiguous()
    row_ids = None if row_ids is None else row_ids.to(torch.long).contiguous()
    shift, scale, lower = _per_row(shift), _per_row(scale), _per_row(lower)
    n, vocab = shift.shape[0], source.shape[1]
    ps = torch.tensor(top_p, dtype=torch.float64)
    bound = torch.empty(n, 1)
    library.pegaserve_top_p_bound(source.data_ptr(), vocab, vocab, _ptr(row_ids), n, shift.data_ptr(),
                                  scale.data_ptr(), _ptr(lower), floor, ps.data_ptr(), num_buckets, bound.data_ptr())
    return bound
