"""Wire transforms: the built-in ones (casts, MXFP8, 128x128 block FP8) run in C++; subclass
:class:`ReshardTransform` to write one in Python."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from . import _core

__all__ = ["ReshardTransform", "SliceInfo", "native_transform"]

SliceInfo = _core.SliceInfo


class ReshardTransform:
    """A conversion applied on the way, with Megatron's hooks. Override:

    * ``should_transform(param) -> bool`` — which parameters it applies to (a :class:`ParamSpec`);
    * ``prepare_send(name, slice, tensor, stream) -> [arrays]`` — on the sender, the wire buffers
      of one op (``slice`` says which block of the parameter, and where it sits in ``tensor``);
    * ``prepare_recv(name, slice, tensor) -> [arrays]`` — on the receiver, buffers of the same
      number and sizes to receive into;
    * ``finalize_recv(name, slice, tensor, buffers, stream)`` — write the received ``buffers``
      into ``tensor``.

    ``tensor`` is the object the caller put in the source or destination map. Return the same
    buffers at every refit (keep them, e.g. in a dict keyed by ``slice.task_id``) so the schedule is
    reused; reshard keeps a reference to each until the transform is dropped. Buffers are moved
    byte for byte and must be contiguous; sender and receiver must agree on their number and sizes
    (reshard refuses a mismatch at schedule time, naming the parameter).
    """

    name = "python"

    def should_transform(self, param: "_core.ParamSpec") -> bool:
        raise NotImplementedError

    def prepare_send(self, name: str, slice: SliceInfo, tensor: Any,
                     stream: Optional[int]) -> Sequence[Any]:
        raise NotImplementedError

    def prepare_recv(self, name: str, slice: SliceInfo, tensor: Any) -> Sequence[Any]:
        raise NotImplementedError

    def finalize_recv(self, name: str, slice: SliceInfo, tensor: Any, buffers: Sequence[Any],
                      stream: Optional[int]) -> None:
        raise NotImplementedError

    # ---- called by the engine ----

    def _bind(self, src: Mapping[str, Any], dst: Mapping[str, Any]) -> "_core.ReshardTransform":
        self._tensors = (src, dst)
        if not hasattr(self, "_wire"):
            self._wire: Dict[Tuple[bool, int], List[Any]] = {}
        if getattr(self, "_native", None) is None:
            self._native = _core.python_transform(self)
        return self._native

    def _hook_prepare_send(self, slice: SliceInfo, stream: Optional[int]) -> List[Any]:
        buffers = list(self.prepare_send(slice.param, slice, self._tensors[0][slice.param], stream))
        self._wire[(True, slice.task_id)] = buffers
        return buffers

    def _hook_prepare_recv(self, slice: SliceInfo) -> List[Any]:
        buffers = list(self.prepare_recv(slice.param, slice, self._tensors[1][slice.param]))
        self._wire[(False, slice.task_id)] = buffers
        return buffers

    def _hook_finalize_recv(self, slice: SliceInfo, stream: Optional[int]) -> None:
        self.finalize_recv(slice.param, slice, self._tensors[1][slice.param],
                           self._wire[(False, slice.task_id)], stream)


def native_transform(transform: Any, src: Mapping[str, Any],
                     dst: Mapping[str, Any]) -> Optional["_core.ReshardTransform"]:
    """The engine-side object of a transform (built-in, Python subclass, or None)."""
    if transform is None or isinstance(transform, _core.ReshardTransform):
        return transform
    if isinstance(transform, ReshardTransform):
        return transform._bind(src, dst)
    raise TypeError(f"{type(transform).__name__} is not a reshard transform (subclass "
                    "reshard.ReshardTransform or use make_mxfp8_transform and friends)")
