"""What execution and bound refits share: the tensors a caller passes, and the staging budget
as bytes."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Protocol, Tuple, Union, runtime_checkable

from . import _core
from .errors import ReshardError, refusal as _refusal

__all__ = ["DLPackArray", "LocalTensor", "TensorLike"]


@runtime_checkable
class DLPackArray(Protocol):
    """What reshard reads an array through: DLPack (PyTorch, CuPy, JAX, NumPy >= 1.22); objects
    with the buffer protocol (NumPy, bytearray) are read too."""

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any: ...

    def __dlpack_device__(self) -> Tuple[int, int]: ...


# Slots (Python 3.11 and later, where a slotted dataclass can still be weakly referenced): the
# check that a call's dicts are the last call's reads a LocalTensor's fields at their offsets
# rather than looking each up by name (7.7 against 48 ns an array).
@dataclass(**({"slots": True, "weakref_slot": True} if sys.version_info >= (3, 11) else {}))
class LocalTensor:
    """A rank's local tensor of one parameter, with what reshard cannot read from it.

    ``scale`` holds the scales of block-scaled formats (MXFP8: E8M0, shape ``[..., K / 32]``;
    128x128 FP8: float32, shape ``[..., ceil(M / 128), ceil(K / 128)]``;
    ``transform.destination_scale(data.shape)`` says which). ``dtype`` names the
    element type when the array's own does not say it (e.g. a ``uint8`` view of FP8 data:
    ``"float8_e4m3"``).
    """

    data: Union[DLPackArray, memoryview]
    scale: Optional[Union[DLPackArray, memoryview]] = None
    dtype: Optional[str] = None


# A tensor in a map of tensors: an array (DLPack or the buffer protocol), or a LocalTensor.
TensorLike = Union[DLPackArray, memoryview, LocalTensor]


def _entries(tensors: Mapping[str, TensorLike]) -> tuple:
    """``tensors`` as four lists (names, arrays, scales, dtype names; the last two None where no
    :class:`LocalTensor` is among them). Lists rather than a tuple a tensor: a MoE refit passes
    thousands of tensors a call, and as many new tuples set off Python's garbage collector over
    the whole heap (a third of the call's time with PyTorch imported)."""
    names, values = list(tensors), list(tensors.values())
    if not any(isinstance(value, LocalTensor) for value in values):
        return names, values, None, None
    data, scales, dtypes = [], [], []
    for value in values:
        local = isinstance(value, LocalTensor)
        data.append(value.data if local else value)
        scales.append(value.scale if local else None)
        dtypes.append(value.dtype if local else None)
    return names, data, scales, dtypes


def _budget_bytes(budget: Optional[Union[int, str]]) -> Optional[int]:
    """``staging_budget`` as bytes (``"unlimited"``: the largest 64-bit value), read as
    ``RESHARD_STAGING_BUDGET`` is (the core's byte counts: 512MiB, 1.5GiB, 4096)."""
    if budget is None:
        return None
    if isinstance(budget, str):
        if budget.strip().lower() == "unlimited":
            return (1 << 64) - 1
        try:
            return _core.parse_bytes(budget)
        except ReshardError as error:
            raise _refusal(f"staging_budget={budget!r}: not a byte count (such as 512MiB, 1GiB "
                           f"or 'unlimited'): {error}") from None
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise _refusal(f"staging_budget={budget!r}: a byte count is a non-negative integer or a "
                       "string such as '512MiB'")
    return budget
