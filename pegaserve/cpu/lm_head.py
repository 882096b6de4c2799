"""The LM head on the CPU: logits = hidden @ weight.T in fp32, with the weight packed once.

The head (vocab x hidden, ~150k rows) is most of a small model's decode step. At 16 rows of the
default model it is bound by FMAs more than by memory: a plain `W.sum()` streams the 155 MB in
~4.5 ms, the 16 x 151936 x 256 FMAs need ~5.5 ms at this CPU's in-cache AVX-512 rate. oneDNN's
prepacked linear takes ~10 ms there, a plain `linear` (which repacks the weight on every call)
~30 ms. `csrc/lm_head.cpp` streams a packed copy of the weight (on huge pages) once per call,
prefetched, with a tile of 8 rows x 48 vocab entries in registers. On the dev machine, one thread
(`python -m benchmarks.lm_head`; a shared machine, so +-15%): ~6 ms at 16 rows against oneDNN's
~11, 1.5-1.8x oneDNN from 8 to 64 rows, ~1.15x at one row (both near the memory stream there);
the batch-16 decode step of the default model ~14.5 ms instead of ~19. Its dot products are
bit-identical to oneDNN's on these machines for hidden sizes up to 1024.

The kernel is built and loaded as the engine's other CPU kernels are (`kernels.lm_head`). Where
the CPU has neither AVX-512 nor AVX2 with FMA and F16C, or the build fails (logged once), the head falls
back to oneDNN's prepacked linear, and to a plain `linear` without oneDNN.

On an AVX2-only CPU (8 lanes, 16 registers) the tile is 4 rows x 24 vocab entries: on an AMD EPYC
without AVX-512, one thread, 16 rows ~15 ms against oneDNN's ~25 (1.7x; 1.4-1.6x from 8 to 64
rows, 1.07x at one row, where both stream the weight at ~16 GB/s), and the batch-16 decode step
of the default model ~26 ms instead of ~36.

The same kernel runs the model's other fp32 linears on the CPU (`FusedLinear`): at decode batch
sizes it is 2-3x MKL's GEMM on the AMD EPYC dev machine (16 x 256 -> 1536: ~65 us against ~215),
and, summing each output over K in a fixed order, its result for a row does not depend on the
other rows in the call.

Threads: the kernel splits the vocab over `torch.get_num_threads()` threads (the engine runs with
one) when a call has enough work to pay for them: threads of torch's own OpenMP pool (the kernels
build with -fopenmp, and the process's libgomp is torch's), never threads of its own, which would
share the cores with torch's spinning OpenMP workers (a batch-16 sampled step: 15 ms instead of 11
on two threads).

`ScreenedHead` reads the head through an fp16 copy of the weight, half the bytes: where the head
streams its weight at the memory's rate (an Intel Xeon host, one thread: 16 rows in ~14.4 ms, one
row in ~10.5), that is what makes a decode step faster. Each fp16 logit comes with a proven bound of
its distance to the fp32 logit `CpuLogits` computes. Its greedy argmax (`pegaserve_lm_head_argmax`)
screens the vocab with the bounds, then computes the fp32 logits of the few entries the screen cannot
rule out (~1 per row on the default model), each the same float as `CpuLogits`' (the same FMA chain);
its upper bounds (`pegaserve_lm_head_upper`) let the sampler draw by rejection with the same law as
from the full logits (pegaserve/sample/screened.py). For row x and entry j, with h_j the fp16 rounding of
weight row w_j, L_j the fp32 logit and A_j the one from h_j (both FMA chains over K, at most 2K
roundings of unit u = 2^-24 on any path):

    |L_j - A_j| <= |x . (w_j - h_j)| + g (sum_k |x_k w_jk| + sum_k |x_k h_jk|) + 2K 2^-126
               <= |x| (|w_j - h_j| + g (|w_j| + |h_j|)) + 2K 2^-126,   g = 2Ku / (1 - 2Ku)

(Cauchy-Schwarz; 2K 2^-126 covers flushed subnormals). Each entry's bound b_j is that bracket plus
K 2^-95, which covers the last term for |x| >= 2^-30, rounded up; a row's scale e is |x| rounded up.
The upper bound A_j + e b_j, rounded once (monotone), is never below L_j. For the argmax, every
entry whose upper bound reaches the best lower bound max_i (A_i - e b_i) is a candidate, so the best
fp32 logit and every entry that ties it are among them. A row it cannot settle (a NaN, |x| < 2^-30,
more than ~256 candidates) falls back to its full logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pegaserve.cpu import kernels, pages

_ALIGNMENT_BYTES = 64  # the kernel's aligned loads of the packed weight
# glibc serves allocations this large from a fresh mmap each time (its mmap threshold stops growing
# at 32 MB), so an output this large is page-faulted anew on every call: 39 MB at 64 rows.
_FRESH_MAPPING_BYTES = 32 << 20

_THREADED_FMAS = 1 << 24  # below, a call is over before extra threads (~30 us each to start) would help

_BOUND_ROWS = 8192  # weight rows at a time when finding the screen's bounds (float64 temporaries)

_HAS_ONEDNN_LINEAR = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class CpuLogits:
    """logits[M, N] = hidden[M, K] @ weight[N, K].T, fp32 on the CPU, for any number of rows M.

    Built once per weight (the packed copy costs as much memory as the weight); `weight` is the
    tensor it was built from, so that its owner can tell when the weight was replaced. The kernel's
    result does not track gradients. `allow_kernel=False` forces the oneDNN fallback.
    """

    def __init__(self, weight: torch.Tensor, *, allow_kernel: bool = True) -> None:
        if not self.supports(weight):
            found = f"{weight.dtype} {tuple(weight.shape)} on {weight.device}"
            raise ValueError(f"CpuLogits needs a 2-D fp32 CPU weight [N, K > 0], got {found}")
        self.weight = weight
        self.vocab_size, self.hidden_size = weight.shape  # N, K
        self._kernel = kernels.lm_head() if allow_kernel else None
        if self._kernel is not None:
            self._packed = _pack(weight.detach(), self._kernel.pegaserve_lm_head_group_cols())
        elif _HAS_ONEDNN_LINEAR:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 16)
        else:
            self._packed = weight.detach()

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        cpu_fp32 = weight.device.type == "cpu" and weight.dtype == torch.float32
        return cpu_fp32 and weight.dim() == 2 and weight.shape[1] > 0

    @property
    def uses_kernel(self) -> bool:
        return self._kernel is not None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N] fp32
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            raise ValueError(f"hidden must be [rows, {self.hidden_size}], got {tuple(hidden.shape)}")
        if self._kernel is None:
            if _HAS_ONEDNN_LINEAR:
                return torch.ops.mkldnn._linear_pointwise(hidden, self._packed, None, "none", [], "")
            return F.linear(hidden, self._packed)
        hidden = hidden.detach().to(device="cpu", dtype=torch.float32).contiguous()
        num_tokens = hidden.shape[0]
        logits = torch.empty(num_tokens, self.vocab_size, dtype=torch.float32)
        if logits.nbytes >= _FRESH_MAPPING_BYTES:
            pages.advise_huge_pages(logits)  # 64 rows: ~15 ms of page faults -> ~2
        if num_tokens:
            threads = torch.get_num_threads() if logits.numel() * self.hidden_size >= _THREADED_FMAS else 1
            self._kernel.pegaserve_lm_head(
                hidden.data_ptr(), num_tokens, self.hidden_size, self._packed.data_ptr(), self.vocab_size,
                logits.data_ptr(), threads,
            )  # fmt: skip
        return logits


class ScreenedHead:
    """The LM head read through an fp16 copy of its weight, with each logit's error bound (the module
    docstring): each row's greedy token (`argmax`), upper bounds of all its logits (`upper_logits`)
    and single fp32 logits (`logits_at`), each exactly what `logits` computes or bounds. Built by
    `of`, where `logits` runs the kernel and its weight is finite in fp16."""

    def __init__(self, logits: CpuLogits, half: torch.Tensor) -> None:
        self.logits = logits
        self._kernel = logits._kernel
        weight = logits.weight.detach()
        self._weight = weight.contiguous()  # the fp32 rows of the candidates
        group_cols = self._kernel.pegaserve_lm_head_group_cols()
        self._packed = _pack(half, group_cols)
        self._bounds = torch.zeros(self._packed.shape[0] * group_cols, dtype=torch.float32)
        self._bounds[: weight.shape[0]] = screen_bounds(weight, half)
        self.mean_bound = float(self._bounds[: weight.shape[0]].double().mean())  # times |x|: a row's typical slack

    @classmethod
    def of(cls, logits: CpuLogits) -> ScreenedHead | None:
        """The screened head of `logits`; None where it runs no kernel or fp16 cannot hold its weight."""
        if not logits.uses_kernel:
            return None
        half = logits.weight.detach().to(torch.float16)
        return cls(logits, half) if bool(torch.isfinite(half).all()) else None  # |w| < 65520

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M] int64
        """Each row's `logits(hidden).argmax(-1)` (the first of equal maxima), bit for bit."""
        hidden = self._rows(hidden)
        tokens = torch.empty(hidden.shape[0], dtype=torch.int64)
        if len(tokens):
            self._kernel.pegaserve_lm_head_argmax(
                hidden.data_ptr(), len(tokens), self.logits.hidden_size, self._packed.data_ptr(),
                self._bounds.data_ptr(), self._weight.data_ptr(), self.logits.vocab_size, tokens.data_ptr(),
                self._threads(len(tokens)),
            )  # fmt: skip
        unsettled = (tokens < 0).nonzero()[:, 0]
        if len(unsettled):
            tokens[unsettled] = self.logits(hidden[unsettled]).argmax(-1)
        return tokens

    def upper_logits(
        self, hidden: torch.Tensor, scales: torch.Tensor, floor: float, cell: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [M, K], [M] -> [M, N], [M, 1], [M, cells]
        """An upper bound of each of `logits(hidden)` (its fp16 logit plus its bound), NaN throughout
        a row the bound cannot cover (a row of norm below 2^-30 or not finite); each row's largest,
        NaN where the row has a NaN; and per cell of `cell` entries (a multiple of 16), the sum of
        2^max((upper - largest) * scale, floor), `scales[row]` each row's (the sampler's cell masses
        of the upper bounds, found on the way)."""
        hidden = self._rows(hidden)
        num_rows, vocab = hidden.shape[0], self.logits.vocab_size
        if cell % 16 or scales.shape != (num_rows,):
            raise ValueError(f"cell must be a multiple of 16 and scales one per row, got {cell}, {tuple(scales.shape)}")
        scales = scales.to(torch.float32).contiguous()
        upper = torch.empty(num_rows, vocab, dtype=torch.float32)
        row_max = torch.empty(num_rows, 1, dtype=torch.float32)
        masses = torch.empty(num_rows, -(-vocab // cell), dtype=torch.float32)
        if num_rows:
            self._kernel.pegaserve_lm_head_upper(
                hidden.data_ptr(), num_rows, self.logits.hidden_size, self._packed.data_ptr(),
                self._bounds.data_ptr(), vocab, scales.data_ptr(), floor, cell, upper.data_ptr(),
                row_max.data_ptr(), masses.data_ptr(), self._threads(num_rows),
            )  # fmt: skip
        return upper, row_max, masses

    def logits_at(self, hidden: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:  # [M, K], [M] -> [M]
        """`logits(hidden)[r, columns[r]]` for each row r, computed alone, the same float."""
        hidden = self._rows(hidden)
        columns = columns.to(torch.int64).contiguous()
        if columns.shape != (hidden.shape[0],) or bool(((columns < 0) | (columns >= self.logits.vocab_size)).any()):
            raise ValueError(f"columns must be one vocab index per row, got {tuple(columns.shape)}")
        found = torch.empty(len(columns), dtype=torch.float32)
        self._kernel.pegaserve_lm_head_logits_at(
            hidden.data_ptr(), len(columns), self.logits.hidden_size, self._weight.data_ptr(), columns.data_ptr(),
            found.data_ptr(),
        )  # fmt: skip
        return found

    def _rows(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.dim() != 2 or hidden.shape[1] != self.logits.hidden_size:
            raise ValueError(f"hidden must be [rows, {self.logits.hidden_size}], got {tuple(hidden.shape)}")
        return hidden.detach().to(device="cpu", dtype=torch.float32).contiguous()

    def _threads(self, num_rows: int) -> int:
        fmas = num_rows * self.logits.vocab_size * self.logits.hidden_size
        return torch.get_num_threads() if fmas >= _THREADED_FMAS else 1


def has_kernel() -> bool:
    """Whether `CpuLogits` runs the kernel here (rather than its oneDNN fallback)."""
    return kernels.lm_head() is not None


def lm_head_reference(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The exact product, in float64: what both CPU paths approximate within fp32 rounding."""
    return hidden.double() @ weight.double().T


def screen_bounds(weight: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Each entry's b_j (the module docstring), in float64, then rounded up to fp32."""
    hidden_size = weight.shape[1]
    two_k_u = 2 * hidden_size * 2.0**-24
    gamma = two_k_u / (1 - two_k_u)
    bounds = torch.empty(weight.shape[0], dtype=torch.float64)
    for first in range(0, weight.shape[0], _BOUND_ROWS):
        w, h = weight[first : first + _BOUND_ROWS].double(), hi[first : first + _BOUND_ROWS].double()
        bracket = (w - h).norm(dim=1) + gamma * (w.norm(dim=1) + h.norm(dim=1))
        bounds[first : first + _BOUND_ROWS] = (bracket + hidden_size * 2.0**-95) * (1 + 2.0**-20)
    rounded = bounds.float()
    return torch.where(rounded.double() < bounds, torch.nextafter(rounded, torch.tensor(float("inf"))), rounded)


def _pack(weight: torch.Tensor, group_cols: int) -> torch.Tensor:
    """[N, K] -> [ceil(N / group_cols), K, group_cols]: each group's K steps contiguous, zeros past N."""
    vocab_size, hidden_size = weight.shape
    num_full, tail = divmod(vocab_size, group_cols)
    packed = torch.empty(num_full + (tail > 0), hidden_size, group_cols, dtype=weight.dtype)
    pages.advise_huge_pages(packed)  # before the first touch
    full = weight[: num_full * group_cols].view(num_full, group_cols, hidden_size)  # [groups, cols, K]
    packed[:num_full].copy_(full.transpose(1, 2))
    if tail:
        packed[num_full].zero_()
        packed[num_full, :, :tail].copy_(weight[num_full * group_cols :].T)
    assert packed.data_ptr() % _ALIGNMENT_BYTES == 0, "torch's CPU allocator aligns to 64 bytes"
    return packed
