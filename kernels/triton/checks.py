"""Input checks shared by the launchers: each failure is a `ValueError` naming the argument.

Launchers check what they can see on the host — ranks, shapes, dtypes, devices, strides. Values
inside index tensors (slot ids, block ids, lengths) stay on the device and are the caller's
invariants, stated in each launcher's docstring; checking them would cost a device sync per call.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

ATTENTION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def interpreting() -> bool:
    """Whether Triton runs kernels on the CPU (`TRITON_INTERPRET=1`, read by triton at import)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_device(name: str, tensor: torch.Tensor, device: torch.device) -> None:
    if tensor.device != device:
        raise ValueError(f"{name}: on {tensor.device}, expected {device} like the other inputs")
    if device.type == "cpu" and not interpreting():
        raise ValueError(f"{name}: a CPU tensor needs TRITON_INTERPRET=1 (set before triton is imported)")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: device {device} is not supported (cuda, or cpu under the interpreter)")


def check_tensor(
    name: str,
    tensor: torch.Tensor,
    *,
    shape: Sequence[int | None],
    dtypes: Sequence[torch.dtype],
    device: torch.device,
    last_dim_contiguous: bool = True,
) -> None:
    """`shape` entries of None accept any size; the last dim must have stride 1 unless told."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != len(shape):
        raise ValueError(f"{name}: expected {len(shape)} dims {_shape_str(shape)}, got shape {tuple(tensor.shape)}")
    for want, got in zip(shape, tensor.shape):
        if want is not None and want != got:
            raise ValueError(f"{name}: expected shape {_shape_str(shape)}, got {tuple(tensor.shape)}")
    if tensor.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {tensor.dtype} is not one of {', '.join(map(str, dtypes))}")
    check_device(name, tensor, device)
    if last_dim_contiguous and tensor.numel() > 1 and tensor.stride(-1) != 1:
        raise ValueError(f"{name}: the last dim must be contiguous (stride 1), got strides {tensor.stride()}")


def check_same_dtype(name: str, tensor: torch.Tensor, dtype: torch.dtype, other: str) -> None:
    if tensor.dtype != dtype:
        raise ValueError(f"{name}: dtype {tensor.dtype} differs from {other}'s {dtype}")


def check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 dots (the reference's precision); half types use tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _shape_str(shape: Sequence[int | None]) -> str:
    return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
