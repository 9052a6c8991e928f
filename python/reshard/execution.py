"""execute_reshard_plan over Python tensors."""

from __future__ import annotations

import warnings
from typing import Any, Mapping, Optional, Union

from . import _core
from .copy_service import CopyService, StreamLike, _refusal, _type_refusal, stream_handle
from .refit import OnCurrentStream, torch_cuda_device, wait_after_transfers
from .tensors import LocalTensor, TensorLike, _budget_bytes, _entries
from .transforms import ReshardTransform, bound_transform, native_transform

__all__ = ["LocalTensor", "execute_reshard_plan", "rerun_reshard_plan"]




def execute_reshard_plan(
    plan: "_core.ReshardPlan",
    src: Mapping[str, TensorLike],
    dst: Mapping[str, TensorLike],
    service: Union[CopyService, "_core.CopyService"],
    transform: Optional[Union["_core.ReshardTransform", ReshardTransform]] = None,
    *deprecated_positional: Any,
    stream: StreamLike = None,
    staging_budget: Optional[Union[int, str]] = None,
    quantize_colocated_on_sender: bool = True,
    strict: bool = True,
) -> "_core.ReshardReport":
    """Moves this rank's source slices into every rank's destination tensors (collective).

    ``src`` and ``dst`` map parameter names to this rank's local tensors (arrays, or
    :class:`LocalTensor` for scales and explicit dtypes). The first call registers and schedules;
    later calls with the same tensors only run, so call it once per refit; where any rank passes
    new tensors, every rank schedules again in that call (the ranks agree on it). With a CUDA
    ``stream`` the work is queued there; otherwise the call returns when the bytes have landed
    (PyTorch CUDA tensors: ordered after PyTorch's current stream). A refit repeated with the same
    tensors is faster bound once: :func:`reshard.bind`.
    A service holds one schedule: alternating two plans (or two sets of tensors) on one service
    registers and schedules again at every switch; give each its own :class:`CopyService` to keep
    both schedules. ``transform`` is a built-in (``make_mxfp8_transform(...)``, ...), an instance
    of a :class:`ReshardTransform` subclass, or a transform written for Megatron-LM's
    ``execute_reshard_plan`` (its four hooks; see :class:`MegatronStyleTransform`).

    ``staging_budget`` bounds the staging memory this rank holds (the built-in transforms' wire
    buffers, slices packed for NCCL): bytes, or a string such as ``"512MiB"`` or
    ``"unlimited"``. A refit that needs more runs in phases that reuse the same memory; a slice
    that alone needs more is refused, naming it; ``0`` allows no staging. Default:
    ``RESHARD_STAGING_BUDGET``, else 2 GiB. Every rank must pass the same.

    Built-in transforms that quantize on arrival quantize on the sender instead for slices between
    two ranks on the same GPU (colocated processes): the same bits, half the bytes moved, no bf16
    landing buffer. ``quantize_colocated_on_sender=False`` keeps every slice on the side the
    transform names. Every rank must pass the same.

    A tensor under a name the plan does not have would never be written: it is refused, naming
    it (as ``load_state_dict(strict=True)`` refuses one); ``strict=False`` ignores such tensors.
    Every rank must pass the same.

    The arguments after ``transform`` are keyword-only (as :func:`reshard.bind`'s); given by
    position they still work, with a ``DeprecationWarning``, until the next release.
    """
    if deprecated_positional:
        stream, staging_budget, quantize_colocated_on_sender, strict = _by_keyword(
            "execute_reshard_plan", deprecated_positional,
            {"stream": stream, "staging_budget": staging_budget,
             "quantize_colocated_on_sender": quantize_colocated_on_sender, "strict": strict},
            {"stream": None, "staging_budget": None, "quantize_colocated_on_sender": True,
             "strict": True})
    core = service.core if isinstance(service, CopyService) else service
    budget = _budget_bytes(staging_budget)
    on_sender = bool(quantize_colocated_on_sender)
    handle, wait = OnCurrentStream(torch_cuda_device(src, dst) if stream is None
                                   else None).handle(stream)
    native = native_transform(transform, src, dst)
    # The same dicts of the same tensors as the last call (one C++ pass over the entries): the
    # refit the last call prepared runs without converting and checking every tensor again.
    key = (plan, transform, budget, on_sender, bool(strict))
    kept = getattr(service, "_prepared_refit", None)
    if kept is not None and all(a is b or a == b for a, b in zip(kept[0], key)) and \
            kept[1].matches(src, dst):
        report = _core.execute_as_prepared(plan, core, native, handle, budget, on_sender,
                                           bool(strict))
        if report is not None:
            if wait is not None:
                wait_after_transfers(core, wait)
            return report
    tensors = (_entries(src), _entries(dst))
    try:
        report = _core.execute_reshard_plan(plan, tensors[0], tensors[1], core, native, handle,
                                            budget, on_sender, bool(strict))
    except BaseException:
        if isinstance(service, CopyService):
            service._hold_refit_tensors(tensors, succeeded=False)
        raise
    if isinstance(service, CopyService):
        service._hold_refit_tensors(tensors, succeeded=True)
        snapshot = (_core.TensorSnapshot(src, dst, LocalTensor)
                    if isinstance(src, dict) and isinstance(dst, dict) else None)
        service._prepared_refit = (key, snapshot) if snapshot is not None else None
    if wait is not None:
        wait_after_transfers(core, wait)
    return report


def rerun_reshard_plan(
    plan: "_core.ReshardPlan",
    service: Union[CopyService, "_core.CopyService"],
    transform: Optional[Union["_core.ReshardTransform", ReshardTransform]] = None,
    *deprecated_positional: Any,
    stream: StreamLike = None,
) -> "_core.ReshardReport":
    """Runs the last refit of ``plan`` on ``service`` again, with the tensors it was given
    (collective), as :meth:`CopyService.run` runs registered buffers.

    Nothing is looked up, converted or compared: where :func:`execute_reshard_plan` takes the
    tensors of every call, checks each against the schedule and has the ranks agree first (about
    1 ms a refit for a MoE model of thousands of tensors in C++, more from Python), this call only
    runs. So every rank must call it in the same refit, with ``transform`` as given to that
    :func:`execute_reshard_plan`, and every tensor of that call must still be where it was (the
    same storage; its values may change). A :class:`CopyService` keeps the tensors of its last
    refit alive for this until the next refit or ``clear_requests()``, so dropping them does not
    hand their memory to other tensors under a rerun (the C++ service, ``service.core``, holds
    none: there the caller keeps them). Refused before any :func:`execute_reshard_plan` of the
    plan on the service, and after ``clear_requests()``. Where tensors change, call
    :func:`execute_reshard_plan` again.
    """
    if deprecated_positional:
        (stream,) = _by_keyword("rerun_reshard_plan", deprecated_positional, {"stream": stream},
                                {"stream": None})
    core = service.core if isinstance(service, CopyService) else service
    return _core.rerun_reshard_plan(plan, core, bound_transform(transform), stream_handle(stream))


def _by_keyword(call: str, positional: tuple, given: dict, defaults: dict) -> list:
    """The keyword-only arguments of ``call`` (``given``, in order) with those a caller passed by
    position (``positional``) filled in, warning that positional use goes in the next release;
    refused where there are too many or one is given both ways."""
    names = list(given)
    if len(positional) > len(names):
        raise _type_refusal(f"{call}() takes at most {len(names)} arguments after transform "
                            f"({', '.join(names)}), by keyword; {len(positional)} were given")
    for name, value in zip(names, positional):
        if given[name] is not defaults[name]:
            raise _type_refusal(f"{call}(): {name} given by position and by keyword")
        given[name] = value
    warnings.warn(f"{call}(): pass {', '.join(n + '=' for n in names[:len(positional)])} by "
                  "keyword; the arguments after transform are keyword-only from the next release",
                  DeprecationWarning, stacklevel=3)
    return [given[name] for name in names]
