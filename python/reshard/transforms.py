"""Wire transforms: the built-in ones (casts, MXFP8, 128x128 block FP8) run in C++; subclass
:class:`ReshardTransform` to write one in Python."""

from __future__ import annotations

import abc
import weakref
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from . import _core
from .errors import state_refusal as _state_refusal
from .errors import type_refusal as _type_refusal
from .tensors import LocalTensor

__all__ = ["MegatronStyleTransform", "ReshardTransform", "SliceInfo", "native_transform"]

SliceInfo = _core.SliceInfo


class ReshardTransform(abc.ABC):
    """A conversion applied on the way, with Megatron's hooks; the built-in transforms
    (``make_mxfp8_transform`` and friends) are instances too. Override:

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


# The built-in transforms (implemented in C++) are ReshardTransforms too.
ReshardTransform.register(_core.ReshardTransform)

_MEGATRON_HOOKS = ("should_transform", "prepare_send", "prepare_recv", "finalize_recv")


class MegatronStyleTransform(ReshardTransform):
    """Runs a transform written for Megatron-LM's ``execute_reshard_plan`` (a subclass of
    ``megatron.core.resharding.transforms.ReshardTransform``, or any object with its four hooks:
    ``should_transform(param_name)``, ``prepare_send(param_name, src_slice, src_param)``,
    ``prepare_recv(param_name, dst_slice)``, ``finalize_recv(param_name, dst_slice,
    recv_buffers)``, slices as tuples of Python slices of the local tensor) in reshard's.

    ``execute_reshard_plan`` wraps such a transform in one of these by itself. Megatron's hooks
    return new tensors at every refit; so that the schedule is made once, the first refit's
    buffers are kept (what is sent, as copies of reshard's): later refits copy what
    ``prepare_send`` returns into them, and receive into the buffers the first ``prepare_recv``
    returned (``finalize_recv`` is given those), unless their number, shapes or dtypes change
    (then reshard schedules again). GPU work of the hooks is queued on reshard's stream (PyTorch
    tensors), so it is ordered with the transfer without a synchronisation.
    """

    def __init__(self, hooks: Any):
        self.hooks = hooks
        self.name = f"megatron:{type(hooks).__name__}"
        self._kept: Dict[Tuple[bool, int], List[Any]] = {}

    def should_transform(self, param: "_core.ParamSpec") -> bool:
        return bool(self.hooks.should_transform(param.name))

    def prepare_send(self, name: str, slice: SliceInfo, tensor: Any,
                     stream: Optional[int]) -> Sequence[Any]:
        with _on_stream(tensor, stream):
            fresh = self.hooks.prepare_send(name, _local_slices(slice), _data(tensor))
            return self._keep(True, slice.task_id, fresh)

    def prepare_recv(self, name: str, slice: SliceInfo, tensor: Any) -> Sequence[Any]:
        fresh = self.hooks.prepare_recv(name, _local_slices(slice))
        return self._keep(False, slice.task_id, fresh)

    def finalize_recv(self, name: str, slice: SliceInfo, tensor: Any, buffers: Sequence[Any],
                      stream: Optional[int]) -> None:
        with _on_stream(tensor, stream):
            self.hooks.finalize_recv(name, _local_slices(slice), list(buffers))

    def _keep(self, sending: bool, task: int, fresh: Sequence[Any]) -> List[Any]:
        fresh = [_contiguous(t) for t in fresh]
        kept = self._kept.get((sending, task))
        if kept is None or len(kept) != len(fresh) or not all(
                _same_kind(k, f) for k, f in zip(kept, fresh)):
            # What is sent is copied into buffers of our own (what the hook returned may be a
            # view of the caller's weights); what is received lands where the hook said.
            kept = [_own_copy(t) for t in fresh] if sending else fresh
            self._kept[(sending, task)] = kept
        elif sending:
            for k, f in zip(kept, fresh):
                _copy_into(k, f)
        return kept


def _local_slices(info: SliceInfo) -> tuple:
    return tuple(slice(o, o + e) for o, e in zip(info.local_offset, info.extent))


def _data(tensor: Any) -> Any:
    return tensor.data if isinstance(tensor, LocalTensor) else tensor


def _contiguous(tensor: Any) -> Any:
    contiguous = getattr(tensor, "contiguous", None)  # PyTorch; NumPy: ascontiguousarray
    if callable(contiguous):
        return contiguous()
    import numpy

    return numpy.ascontiguousarray(tensor)


def _own_copy(tensor: Any) -> Any:
    clone = getattr(tensor, "clone", None)
    if callable(clone):
        return clone()
    import numpy

    return numpy.array(tensor, copy=True)


def _same_kind(a: Any, b: Any) -> bool:
    return (tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype and
            str(getattr(a, "device", "cpu")) == str(getattr(b, "device", "cpu")))


def _copy_into(kept: Any, fresh: Any) -> None:
    if hasattr(kept, "copy_"):
        kept.copy_(fresh)
    else:
        kept[...] = fresh


class _on_stream:
    """Queues PyTorch's GPU work of a hook on reshard's stream (a no-op elsewhere)."""

    def __init__(self, tensor: Any, stream: Optional[int]):
        self._context = None
        tensor = _data(tensor)
        if stream is not None and getattr(getattr(tensor, "device", None), "type", "") == "cuda":
            import torch

            self._context = torch.cuda.stream(torch.cuda.ExternalStream(stream,
                                                                        device=tensor.device))

    def __enter__(self):
        if self._context is not None:
            self._context.__enter__()

    def __exit__(self, *exc):
        if self._context is not None:
            return self._context.__exit__(*exc)
        return False


# The adapters of Megatron-style transforms, one per transform for its lifetime, so that every
# refit reaches the same engine-side transform (and reuses its schedule).
_ADAPTERS: "weakref.WeakKeyDictionary[Any, MegatronStyleTransform]" = weakref.WeakKeyDictionary()


def _megatron_adapter(hooks: Any) -> MegatronStyleTransform:
    try:
        adapter = _ADAPTERS.get(hooks)
        if adapter is None:
            adapter = _ADAPTERS[hooks] = MegatronStyleTransform(hooks)
        return adapter
    except TypeError:  # not hashable or not weakly referable: keep it on the object
        adapter = getattr(hooks, "_reshard_adapter", None)
        if adapter is None:
            adapter = MegatronStyleTransform(hooks)
            setattr(hooks, "_reshard_adapter", adapter)
        return adapter


def bound_transform(transform: Any) -> Optional["_core.ReshardTransform"]:
    """The engine-side object a transform was last executed with, bound to that refit's
    tensors; refused where the transform never was."""
    if transform is None or isinstance(transform, _core.ReshardTransform):
        return transform
    if not isinstance(transform, ReshardTransform):
        if not all(callable(getattr(transform, hook, None)) for hook in _MEGATRON_HOOKS):
            raise _type_refusal(f"{type(transform).__name__} is not a reshard transform")
        transform = _megatron_adapter(transform)
    native = getattr(transform, "_native", None)
    if native is None:
        raise _state_refusal(
            f"rerun_reshard_plan: transform {type(transform).__name__} was never passed to "
            "execute_reshard_plan; execute the plan with it first")
    return native


def native_transform(transform: Any, src: Mapping[str, Any],
                     dst: Mapping[str, Any]) -> Optional["_core.ReshardTransform"]:
    """The engine-side object of a transform (built-in, Python subclass, a transform written for
    Megatron-LM, or None)."""
    if transform is None or isinstance(transform, _core.ReshardTransform):
        return transform
    if isinstance(transform, ReshardTransform):
        return transform._bind(src, dst)
    if all(callable(getattr(transform, hook, None)) for hook in _MEGATRON_HOOKS):
        return _megatron_adapter(transform)._bind(src, dst)
    raise _type_refusal(f"{type(transform).__name__} is not a reshard transform (subclass "
                        "reshard.ReshardTransform, use make_mxfp8_transform and friends, or pass a "
                        "transform with Megatron's hooks: should_transform, prepare_send, "
                        "prepare_recv, finalize_recv)")
