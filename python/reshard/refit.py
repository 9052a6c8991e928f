"""A refit bound once to its tensors and run as often as needed: ``reshard.bind``."""

from __future__ import annotations

import fnmatch
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

from . import _core
from .copy_service import CopyService, StreamLike, stream_handle
from .errors import (
    refusal as _refusal,
    state_refusal as _state_refusal,
    type_refusal as _type_refusal,
)
from .tensors import LocalTensor, _budget_bytes, _entries
from .transforms import ReshardTransform, native_transform

__all__ = ["BoundRefit", "RefitGraph", "bind"]


def _array(value: Any) -> Any:
    return value.data if isinstance(value, LocalTensor) else value


def torch_cuda_device(*maps: Mapping[str, Any]) -> Optional[int]:
    """The CUDA device of the first PyTorch CUDA tensor among ``maps``' values (a rank's tensors
    are on one GPU), or None where the first tensor is not one."""
    for tensors in maps:
        for value in tensors.values():
            array = _array(value)
            if type(array).__module__.startswith("torch") and getattr(array, "is_cuda", False):
                return array.device.index if array.device.index is not None else 0
            return None
    return None


class OnCurrentStream:
    """Where no stream is given and the tensors are PyTorch CUDA tensors: the call runs on
    PyTorch's *current* stream (after whatever the caller queued there, as c10d collectives
    are ordered) and then waits for it, so it still returns when the bytes have landed. Without
    it the refit would be ordered only after the legacy default stream, and writes the caller
    queued on another current stream could race its reads."""

    def __init__(self, device: Optional[int]):
        self.device = device

    def handle(self, stream: StreamLike) -> tuple:
        """(the stream handle to pass, the torch stream to wait for afterwards or None)."""
        if stream is not None or self.device is None:
            return stream_handle(stream), None
        import torch
        current = torch.cuda.current_stream(self.device)
        return current.cuda_stream, current


def wait_after_transfers(service: Any, stream: Any) -> None:
    """Waits for a PyTorch stream a refit ran on. Its transfers wait for peers, so they are
    waited for first through the copy service, which notices a peer that exited or stopped and
    gives up at its timeout (the stream's own wait would never end); what the stream holds after
    them is local work."""
    service.synchronize()
    stream.synchronize()


class GroupNumbers(tuple):
    """Groups already resolved: (the group number of each of the plan's parameters, the groups'
    names), as :func:`name_groups` returns them."""

    def __new__(cls, numbers: Sequence[int], names: Sequence[str]):
        return super().__new__(cls, (list(numbers), list(names)))


GroupsSpec = Union[None, str, Mapping[str, Sequence[str]], Callable[[str], str], GroupNumbers]


def name_groups(names: Sequence[str], groups: GroupsSpec) -> tuple:
    """(the group number of each name, the groups' names) for ``bind``'s ``groups``:
    ``"layers"`` (one group per layer, ``"layers.7"``, plus ``"embeddings"`` for
    names containing ``embed`` and ``"head"`` for the other names without a layer number), a
    mapping of group names to parameter names or ``fnmatch`` patterns (in its order; a parameter
    matched by none joins a last group ``"rest"``, one matched by two groups is refused), or a
    function from a parameter's name to its group's name (groups in the plan's order)."""
    if isinstance(groups, GroupNumbers):
        return groups
    if groups == "layers":
        numbers, group_names = _core.layer_groups(list(names))
        return list(numbers), list(group_names)
    if isinstance(groups, str):
        raise _refusal(f"groups={groups!r}: give 'layers', a mapping of group names to "
                       "parameter names or patterns, or a function of a parameter's name")
    if callable(groups):
        number: Dict[str, int] = {}  # in the order the names first give each group
        numbers = []
        for name in names:
            group = groups(name)
            if not isinstance(group, str):
                raise _type_refusal(f"groups({name!r}) returned {group!r}; a group's name (str) "
                                    "is needed")
            numbers.append(number.setdefault(group, len(number)))
        return numbers, list(number)
    group_names = list(groups)
    numbers = []
    for name in names:
        found = [g for g, (group, patterns) in enumerate(groups.items())
                 if any(name == p or fnmatch.fnmatchcase(name, p) for p in patterns)]
        if len(found) > 1:
            raise _refusal(f"parameter {name!r} is in groups "
                           f"{[group_names[g] for g in found]}; a parameter belongs to one")
        if not found:
            if "rest" not in group_names:
                group_names.append("rest")
            found = [group_names.index("rest")]
        numbers.append(found[0])
    return numbers, group_names


class BoundRefit:
    """A refit bound once to this rank's tensors (see :func:`bind`): ``run()`` every refit."""

    def __init__(self, plan: "_core.ReshardPlan", src: Mapping[str, Any], dst: Mapping[str, Any],
                 service: Union[CopyService, "_core.CopyService"], transform: Any = None,
                 stream: StreamLike = None, staging_budget: Optional[Union[int, str]] = None,
                 quantize_colocated_on_sender: bool = True, strict: bool = True,
                 staged: bool = False, max_staged_bytes: Optional[Union[int, str]] = None,
                 groups: GroupsSpec = None):
        # The refit's own maps: they hold the tensors (no tensor can be freed under the refit),
        # and a Python transform reads the tensors through them, so update() changes both.
        self._src: Dict[str, Any] = dict(src)
        self._dst: Dict[str, Any] = dict(dst)
        self._service = service
        self._transform = transform
        self._ordering = OnCurrentStream(torch_cuda_device(self._src, self._dst))
        core_service = service.core if isinstance(service, CopyService) else service
        handle, wait = self._ordering.handle(stream)
        arguments = (plan, _entries(self._src), _entries(self._dst), core_service,
                     native_transform(transform, self._src, self._dst), handle,
                     _budget_bytes(staging_budget), bool(quantize_colocated_on_sender),
                     bool(strict))
        self._staged = bool(staged)
        self._group_names: List[str] = []
        self._group_number: Dict[str, int] = {}
        numbers: List[int] = []
        if groups is not None:
            numbers, self._group_names = name_groups([p.name for p in plan.params], groups)
            self._group_number = {g: i for i, g in enumerate(self._group_names)}
        if self._staged:
            self._core = _core.StagedRefit(*arguments, _budget_bytes(max_staged_bytes), numbers)
        else:
            if max_staged_bytes is not None:
                raise _refusal("max_staged_bytes is for a staged refit (staged=True)")
            self._core = _core.Refit(*arguments, numbers)
        if wait is not None:
            self._wait(wait)

    def run(self, stream: StreamLike = None,
            groups: Union[None, str, Sequence[str]] = None) -> "_core.ReshardReport":
        """Moves every bound source slice into every rank's bound destination tensors
        (collective: every rank calls it in the same refit). Nothing is looked up, converted or
        checked per tensor and no host collective runs. With a CUDA ``stream`` the work is queued
        there and the call returns at once (capturable in ``torch.cuda.graph``); without one it
        returns when the bytes have landed, ordered after PyTorch's current stream for PyTorch
        CUDA tensors (else after the legacy default stream). The tensors' contents may change
        between runs; to give the refit other tensors, :meth:`update` it.

        ``groups`` (a refit bound with ``groups=``): only those groups, by name or ``fnmatch``
        pattern over :attr:`groups` (``"layers.1?"``); bitwise what a whole run writes into their
        parameters' destinations, nothing else touched. Every rank must run the same groups in
        the same calls."""
        if self._staged:
            report = self.stage(stream, groups)
            self.commit(stream, groups)
            return report
        if groups is None:
            return self._ordered(self._core.run, stream)
        chosen = self._chosen_groups(groups)
        return self._ordered(lambda handle: self._core.run_groups(chosen, handle), stream)

    @property
    def groups(self) -> List[str]:
        """The groups the refit was bound with (``bind(..., groups=)``), in the order they run;
        empty where it was bound without."""
        return list(self._group_names)

    def _chosen_groups(self, groups: Union[str, Sequence[str]], call: str = "run") -> List[int]:
        if not self._group_names:
            raise _refusal(f"{call}(groups=...): this refit was bound without groups; bind it "
                           "with groups='layers' (or a mapping or function) to run parts of it")
        chosen = set()
        for wanted in [groups] if isinstance(groups, str) else groups:
            number = self._group_number.get(wanted)
            if number is not None:
                chosen.add(number)
                continue
            matched = [i for i, g in enumerate(self._group_names)
                       if fnmatch.fnmatchcase(g, wanted)]
            if not matched:
                shown = ", ".join(self._group_names[:8]) + (
                    ", ..." if len(self._group_names) > 8 else "")
                raise _refusal(f"{call}(groups=...): {wanted!r} names no group of this refit "
                               f"(its {len(self._group_names)} groups: {shown})")
            chosen.update(matched)
        return sorted(chosen)

    def _ordered(self, call: Any, stream: StreamLike, transfers: bool = True) -> Any:
        """``call(stream handle)``: on ``stream`` where given; for PyTorch CUDA tensors without
        one, on PyTorch's current stream and waited for (see :class:`OnCurrentStream`).
        ``transfers``: whether the call moves bytes between ranks (not a commit)."""
        if self._ordering.device is None or stream is not None:
            return call(stream_handle(stream))
        handle, wait = self._ordering.handle(None)
        result = call(handle)
        self._wait(wait, transfers)
        return result

    def _wait(self, wait: Any, transfers: bool = True) -> None:
        if transfers:
            wait_after_transfers(self._service, wait)
        else:
            wait.synchronize()

    def stage(self, stream: StreamLike = None,
              groups: Union[None, str, Sequence[str]] = None) -> "_core.ReshardReport":
        """A staged refit (``bind(..., staged=True)``): moves every byte into staging on the
        destination ranks while the destination tensors keep their values (collective, as
        :meth:`run`). A failure here leaves every destination tensor as it was, and its error
        says so. Stream and ordering as for :meth:`run`. ``groups`` (a refit bound with
        ``groups=``): only those groups, as :meth:`run` takes them; what other groups staged
        stays staged."""
        core = self._staged_core("stage")
        if groups is None:
            return self._ordered(core.stage, stream)
        chosen = self._chosen_groups(groups, "stage")
        return self._ordered(lambda handle: core.stage_groups(chosen, handle), stream)

    def commit(self, stream: StreamLike = None,
               groups: Union[None, str, Sequence[str]] = None) -> None:
        """Writes what the last :meth:`stage` staged into this rank's destination tensors, on
        this rank alone (no collective: each engine rank commits when it pauses), and advances
        :attr:`version`. A local device copy of the blocks the plan writes, one launch per group;
        with a ``stream`` queued there (after a stage queued on it; capturable), otherwise it
        returns when the tensors hold the new values. Refused where nothing is staged.
        ``groups``: only those groups' parameters switch (each must be staged; a layer at a time,
        say), the others keep their values."""
        core = self._staged_core("commit")
        if groups is None:
            return self._ordered(core.commit, stream, transfers=False)
        chosen = self._chosen_groups(groups, "commit")
        self._ordered(lambda handle: core.commit_groups(chosen, handle), stream, transfers=False)

    @property
    def version(self) -> int:
        """A staged refit's commits on this rank: the weight version its tensors hold."""
        return self._staged_core("version").version

    @property
    def staged(self) -> bool:
        """Whether every group is staged: a :meth:`stage` succeeded since the last
        :meth:`commit`."""
        return self._staged_core("staged").staged

    @property
    def staged_groups(self) -> List[str]:
        """The groups staged since their last commit (a refit bound with ``groups=``)."""
        numbers = self._staged_core("staged_groups").staged_groups
        return [self._group_names[g] for g in numbers] if self._group_names else []

    @property
    def staged_bytes(self) -> int:
        """The staging a staged refit holds on this rank (a twin of each destination tensor)."""
        return self._staged_core("staged_bytes").staged_bytes

    def _staged_core(self, what: str) -> Any:
        if not self._staged:
            raise _state_refusal(f"{what}: this refit is not staged; bind it with staged=True "
                                 "to stage and commit")
        return self._core

    def update(self, src: Optional[Mapping[str, Any]] = None,
               dst: Optional[Mapping[str, Any]] = None,
               stream: StreamLike = None) -> "_core.ReshardReport":
        """Replaces the named tensors (names bound by :func:`bind`; the others stay), collective.
        Where no rank's tensors differ from those bound (the same memory, dtype and shape), this
        costs one small all-gather; otherwise every rank prepares and schedules again
        (``report.rescheduled``). A refusal on any rank (an unknown name, a bad tensor) raises the
        same error on every rank and leaves the refit as it was."""
        src, dst = dict(src or {}), dict(dst or {})
        handle, wait = self._ordering.handle(stream)
        report = self._core.update(_entries(src), _entries(dst), handle)
        if wait is not None:
            self._wait(wait)
        # Only now: a refused update leaves the refit's tensors (and a Python transform's view
        # of them) as they were.
        self._src.update(src)
        self._dst.update(dst)
        return report

    def capture_graph(self, stream: StreamLike = None) -> "RefitGraph":
        """The refit's :meth:`run` captured once in a CUDA graph (the ``cuda`` transport;
        built-in conversions included), to replay at the host cost of one graph launch: see
        :class:`RefitGraph`. Capturing moves no bytes and waits for no peer, but counts as a
        run begun: every rank captures where the others do. ``stream`` is the stream to
        capture on (a side stream of its own where None)."""
        if self._core is None:
            raise _state_refusal("capture_graph(): this refit was closed; bind it again")
        if self._staged:
            raise _state_refusal("capture_graph(): a staged refit stages and commits in two "
                                 "calls; capture stage() and commit() with torch.cuda.graph")
        return RefitGraph(self._core, stream_handle(stream), (dict(self._src), dict(self._dst)))

    @property
    def report(self) -> "_core.ReshardReport":
        """What binding (or the last update that scheduled again) prepared: bytes on the wire,
        staging held, phases."""
        return self._core.report

    @property
    def sources(self) -> Mapping[str, Any]:
        return dict(self._src)

    @property
    def destinations(self) -> Mapping[str, Any]:
        return dict(self._dst)

    def close(self) -> None:
        """Frees the refit's staging, streams and schedule state now (as dropping it does), and
        the tensors it holds."""
        self._core = None
        self._src.clear()
        self._dst.clear()

    def __enter__(self) -> "BoundRefit":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class RefitGraph(_core.RefitGraph):
    """A bound refit's run captured in a CUDA graph (:meth:`BoundRefit.capture_graph`).

    ``replay(stream=None)`` queues the whole refit with one graph launch on ``stream`` (the
    legacy default stream, PyTorch's default stream, where None) and returns at once: order it
    after your writes to the sources as you would a kernel, and before your reads of the
    destinations. Every rank replays as it would :meth:`BoundRefit.run` (the same refits, in
    the same order). A replay moves the tensors the refit was bound to at capture: after an
    ``update()`` that scheduled again it raises :class:`reshard.ReshardError`; capture again.
    The graph holds those tensors and the refit's state until it is dropped. Unlike ``run()``,
    a replay is not followed by the service's watchdog: a same-GPU peer that dies while a
    replay waits for it is found by the kernels' own timeouts only."""

    # replay(stream=None) is the native method itself: a replay is one launch, and a Python
    # frame in front of it would cost about as much.

    def __init__(self, refit: "_core.Refit", stream: Optional[int], tensors: tuple):
        super().__init__(refit, stream)
        self._tensors = tensors  # alive as long as the graph may write or read them


def bind(plan: "_core.ReshardPlan", src: Mapping[str, Any], dst: Mapping[str, Any],
         service: Union[CopyService, "_core.CopyService"], transform: Any = None, *,
         stream: StreamLike = None, staging_budget: Optional[Union[int, str]] = None,
         quantize_colocated_on_sender: bool = True, strict: bool = True, staged: bool = False,
         max_staged_bytes: Optional[Union[int, str]] = None,
         groups: GroupsSpec = None) -> BoundRefit:
    """Binds a refit of ``plan`` to this rank's tensors, once (collective: every rank at once).

    ``src`` and ``dst`` map parameter names to this rank's local tensors (arrays, or
    :class:`LocalTensor` for scales and explicit dtypes), as for :func:`execute_reshard_plan`.
    Every rank checks that all hold the same plan, checks each tensor against the plan's layouts,
    places the staging and schedules; a refusal on any rank raises the same error on every rank,
    naming the rank and the cause. The refit holds its tensors (they cannot be freed under it),
    its schedule and staging, and frees them when dropped or :meth:`BoundRefit.close`\\ d; then
    ``refit.run()`` every refit costs what moving the bytes costs. A service holds one schedule:
    bind each refit that must stay ready on its own :class:`CopyService`. ``transform``,
    ``staging_budget``, ``quantize_colocated_on_sender`` and ``strict`` (tensors under names the
    plan lacks refused, or with ``False`` ignored) as for :func:`execute_reshard_plan`.

    ``staged=True`` binds a refit an engine can serve through: the bytes land in a twin of each
    destination tensor that the refit owns; ``refit.stage()`` moves them while the engine keeps
    reading its weights, ``refit.commit()`` then writes them into the destination tensors on
    each rank alone (a local copy, the only pause the engine sees) and advances
    ``refit.version``; a failure before ``commit()`` leaves every destination tensor as it was.
    ``run()`` is then ``stage()`` and ``commit()``. The twins cost as much memory as the rank's
    destination tensors (``refit.staged_bytes``); ``max_staged_bytes`` (bytes or ``"8GiB"``)
    refuses a refit that needs more, on every rank, saying how much.

    ``groups`` makes parts of the refit that run on their own, without planning again:
    ``"layers"`` (one group per layer, plus ``"embeddings"`` and ``"head"``: a layer at a time
    beside generation), a mapping ``{"lora": ["*.lora_A.*", "*.lora_B.*"]}`` (parameters matched
    by none form a last group ``"rest"``), or a function of a parameter's name returning its
    group's name (``lambda name: name`` gives each parameter its own). ``refit.groups`` lists
    them; ``refit.run(groups=["layers.3"])`` runs some. Each group runs in phases of its own, so
    a whole ``run()`` of a grouped refit pays a little per group over an ungrouped one; every
    rank must group alike (refused otherwise).
    """
    return BoundRefit(plan, src, dst, service, transform, stream, staging_budget,
                      quantize_colocated_on_sender, strict, staged, max_staged_bytes, groups)
