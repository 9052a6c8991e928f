"""reshard as a Megatron-LM copy service (``megatron.core.resharding``).

    from reshard.megatron import ReshardCopyService
    swap_model_weights(src_model, dst_model, refit_method=ReshardCopyService())

Needs PyTorch (Megatron hands it torch tensors). Where ``megatron.core`` is importable,
:class:`ReshardCopyService` is a subclass of Megatron's ``CopyService``, so
``swap_model_weights`` accepts it; constructed inside a ``torch.distributed`` job it bootstraps
from the default process group (or ``group=``), and the ranks Megatron passes (global ranks) are
translated to that group's ranks. Made with ``transport="auto"`` (the default), the service is set
up at the first ``run()``, for the tensors handed over: the host transport where every rank's are
CPU tensors (on a machine with GPUs, "auto" alone would choose the CUDA transport).

Megatron submits every send and receive of a refit, then calls ``run()``; each refit it hands over
fresh temporaries (``.contiguous()`` copies, new receive buffers). The first refit registers and
schedules them; every later refit whose pattern is unchanged on every rank (task ids, peers and
byte counts: the ranks agree collectively, so none re-plans alone) reuses that schedule, copying
the new tensors into the ones registered first (and the received bytes out of them). No refit
after the first plans again. That agreement opens each refit as a meeting: a rank that comes late
is waited for ``arrival_timeout``; past it every rank's refit fails alike (``error.retryable``:
``swap_model_weights`` called again on every rank runs it). Several tensors under one task id (Megatron's MXFP8 transform sends
data and scales under one) travel in the order submitted. Non-contiguous tensors (strided views)
go through contiguous copies.

:class:`RemoteCopyService` is reshard's :class:`~reshard.CopyService` under the name and keywords
of Megatron's NVSHMEM ``RemoteCopyService`` (``register_receive(task_id, dest_tensor, dest_pos,
size, src_pe)``), so code written against it runs by changing the import.
"""

from __future__ import annotations

import array
import hashlib
import struct
from typing import Any, List, NamedTuple, Optional, Tuple

from .copy_service import CopyService, _task_id, _whole_or_range, make_bootstrap
from .errors import (
    refusal as _refusal,
    state_refusal as _state_refusal,
    type_refusal as _type_refusal,
)

__all__ = ["ReshardCopyService", "RemoteCopyService", "StagedSwap", "MEGATRON_AVAILABLE"]

try:
    from megatron.core.resharding.copy_services.base import CopyService as _MegatronCopyService

    MEGATRON_AVAILABLE = True
except ImportError:  # no Megatron (or no torch): a plain base with the same methods
    MEGATRON_AVAILABLE = False

    class _MegatronCopyService:  # type: ignore[no-redef]
        pass


# Task ids Megatron leaves out are numbered per (source, destination) pair in submission order,
# in a range of their own so they cannot meet an explicit id.
_IMPLICIT_TASK = 1 << 63
# Without a task id, the k-th tensor from rank s to rank d travels as
# _IMPLICIT_TASK | s << 2 * _PAIR_BITS | d << _PAIR_BITS | k.
_PAIR_BITS = 21
# An explicit task id's k-th tensor travels as (task_id << _SUB_BITS) | k.
_SUB_BITS = 8
_MAX_EXPLICIT_TASK = (1 << (63 - _SUB_BITS)) - 1


def _torch():
    try:
        import torch
    except ImportError as error:
        raise ImportError("reshard.megatron needs PyTorch: Megatron's copy services move torch "
                          "tensors (pip install torch)") from error
    return torch


class _Submitted:
    """The tensors of one direction of a refit, in submission order, as parallel lists: a refit
    submits thousands, and an object each set off Python's garbage collector over the whole heap
    (more than half of a refit's time, 10,000 tensors with Megatron imported)."""

    __slots__ = ("tasks", "tensors", "peers")

    def __init__(self) -> None:
        self.tasks: List[int] = []
        self.tensors: List[Any] = []
        self.peers: List[int] = []

    def add(self, task: int, tensor: Any, peer: int) -> None:
        self.tasks.append(task)
        self.tensors.append(tensor)
        self.peers.append(peer)


class ReshardCopyService(_MegatronCopyService):
    """Megatron's ``CopyService`` interface over a reshard :class:`~reshard.CopyService`.

    ``service``: a reshard copy service to use (else one is made with ``transport``);
    ``group``: the ``torch.distributed`` process group of the job (None: the default group);
    ``bootstrap``: anything :func:`reshard.make_bootstrap` accepts, instead of the process group;
    any other keyword is a setting of the service made here (``timeout=10``, ``cuda={"engine":
    "ce"}``: see :class:`reshard.CopyService`). On ``transport="auto"`` a service not yet set up
    (``init()``) is set up at the first ``run()``: the host transport where every rank hands over
    CPU tensors, else what "auto" picks; CPU tensors on some ranks and GPU tensors on others are
    refused on every rank.
    """

    # What Megatron's refit loop asks of a copy service.
    requires_process_group_barrier = False
    supports_multiple_runs_per_plan = True

    def __init__(self, service: Optional[CopyService] = None, transport: str = "auto",
                 group: Any = None, bootstrap: Any = None, log_level: str = "WARN",
                 **settings: Any) -> None:
        torch = _torch()
        self._group = group
        if service is None:
            if bootstrap is None:
                dist = torch.distributed
                distributed = dist.is_available() and dist.is_initialized()
                bootstrap = (group if group is not None else "torch") if distributed else None
            service = CopyService(transport=transport, bootstrap=bootstrap, **settings)
        elif settings:
            raise _type_refusal(f"ReshardCopyService: settings {sorted(settings)} apply to the "
                                "service it makes; pass them to the CopyService given instead")
        self._log_level = log_level
        # An unset-up service on "auto" is set up at the first run(), for the tensors handed over.
        self._transport_from_tensors = (isinstance(service, CopyService)
                                        and not service.initialized
                                        and service.options.transport == "auto")
        if not service.initialized and not self._transport_from_tensors:
            service.init(log_level)
        self.service = service
        self.rank = service.my_pe
        self.world_size = service.n_pes
        self._sends, self._recvs = _Submitted(), _Submitted()
        # The contiguous tensors registered by the last schedule, per direction, as byte views
        # and as views with the dtype and shape of the tensors they were registered for.
        self._scheduled: Optional[Tuple[List[Any], List[Any]]] = None
        self._scheduled_views: Optional[Tuple[List[Any], List[Any]]] = None
        self._on_gpu = False
        self._scheduled_pattern: Optional[bytes] = None
        self._implicit_counts: dict = {}
        self._explicit_counts: dict = {}
        self.schedules = 0  # how many times a refit planned (registered and scheduled)

    # ---- ranks and task ids ----

    def _peer(self, rank: int) -> int:
        """Megatron's (global) rank as a rank of this service's group."""
        if self._group is None:
            return rank
        return _torch().distributed.get_group_rank(self._group, rank)

    def _task(self, task_id: Optional[int], src: int, dst: int, sending: bool) -> int:
        if task_id is None:
            index = self._implicit_counts.get((src, dst), 0)
            self._implicit_counts[(src, dst)] = index + 1
            return _IMPLICIT_TASK | (src << 2 * _PAIR_BITS) | (dst << _PAIR_BITS) | index
        task_id = int(task_id)
        if not 0 <= task_id <= _MAX_EXPLICIT_TASK:
            raise _refusal(f"task id {task_id} is outside 0..{_MAX_EXPLICIT_TASK}")
        key = (sending, task_id)
        index = self._explicit_counts.get(key, 0)
        if index >= 1 << _SUB_BITS:
            raise _refusal(f"task id {task_id}: more than {1 << _SUB_BITS} tensors under one id")
        self._explicit_counts[key] = index + 1
        return (task_id << _SUB_BITS) | index

    # ---- Megatron's interface ----

    def submit_send(self, src_tensor: Any, dest_rank: int, task_id: Optional[int] = None) -> None:
        """Registers ``src_tensor`` (all of it) to go to ``dest_rank``."""
        peer = self._peer(dest_rank)
        self._sends.add(self._task(task_id, self.rank, peer, True), src_tensor, peer)

    def submit_recv(self, dest_tensor: Any, src_rank: int, task_id: Optional[int] = None) -> None:
        """Registers ``dest_tensor`` (all of it) to be filled from ``src_rank``."""
        peer = self._peer(src_rank)
        self._recvs.add(self._task(task_id, peer, self.rank, False), dest_tensor, peer)

    def submit_send_with_id(self, task_id: int, src_tensor: Any, dest_rank: int) -> None:
        self.submit_send(src_tensor, dest_rank, task_id=task_id)

    def submit_recv_with_id(self, task_id: int, dest_tensor: Any, src_rank: int) -> None:
        self.submit_recv(dest_tensor, src_rank, task_id=task_id)

    def run(self) -> None:
        """Moves every submitted tensor, then forgets the submissions (as Megatron expects)."""
        torch = _torch()
        try:
            if self._transport_from_tensors:
                self._init_for_tensors()
            pattern = self._pattern()
            if not self._all_reuse(pattern == self._scheduled_pattern):
                self._register()
                self._scheduled_pattern = pattern
            (sends, recvs), (send_views, recv_views) = self._scheduled, self._scheduled_views
            _copy_all(torch, sends, send_views, self._sends.tensors, into_wires=True)
            self.service.run(torch.cuda.current_stream() if self._on_gpu else None)
            _copy_all(torch, recvs, recv_views, self._recvs.tensors, into_wires=False)
        finally:
            # Forgotten whether the refit moved or failed: the next one is submitted afresh.
            self._sends, self._recvs = _Submitted(), _Submitted()
            self._implicit_counts.clear()
            self._explicit_counts.clear()

    def close(self) -> None:
        """Releases the service."""
        self.service.finalize()

    finalize = close

    def _init_for_tensors(self) -> None:
        """Collective: sets the service up for the tensors of the first refit. On a machine with
        GPUs "auto" means the CUDA transport, which cannot read CPU tensors: where every rank
        hands over CPU tensors (a model kept on the CPU), the host transport moves them."""
        kinds = sorted({t.device.type for t in self._sends.tensors + self._recvs.tensors})
        gathered = [part.decode().split(",") if part else []
                    for part in self.service.all_gather(",".join(kinds).encode())]
        transport = transport_for_tensor_devices(gathered)
        if transport != "auto":
            self.service._choose_transport(transport)
        self.service.init(self._log_level)
        self._transport_from_tensors = False

    # ---- planning once ----

    def _pattern(self) -> bytes:
        digest = hashlib.blake2b(digest_size=16)
        for submitted in (self._sends, self._recvs):
            digest.update(struct.pack("<q", len(submitted.tasks)))
            digest.update(array.array("Q", submitted.tasks).tobytes())
            digest.update(array.array("q", submitted.peers).tobytes())
            digest.update(array.array("q", map(_nbytes, submitted.tensors)).tobytes())
        return digest.digest()

    def _all_reuse(self, mine: bool) -> bool:
        """Collective, where the ranks meet at each refit: whether every rank can run its
        existing schedule. A rank that comes late (an engine finishing its work) is waited for
        ``arrival_timeout``; past it every rank's refit fails alike (``retryable``: Megatron's
        ``swap_model_weights`` called again on every rank runs it)."""
        parts = self.service._meet(b"\1" if mine else b"\0", "ReshardCopyService.run()")
        return all(part == b"\1" for part in parts)

    def _register(self) -> None:
        torch = _torch()
        svc = self.service
        # Nothing is scheduled until this succeeds: a refit that fails here plans again next time.
        self._scheduled = self._scheduled_pattern = None
        svc.clear_requests()
        scheduled: Tuple[List[Any], List[Any]] = ([], [])
        views: Tuple[List[Any], List[Any]] = ([], [])
        for submitted, register, wires, typed in (
                (self._sends, svc.register_send, scheduled[0], views[0]),
                (self._recvs, svc.register_receive, scheduled[1], views[1])):
            for task, tensor, peer in zip(submitted.tasks, submitted.tensors, submitted.peers):
                tensor = tensor.detach()
                wire = tensor if tensor.is_contiguous() else tensor.contiguous()
                typed.append(wire)
                wires.append(wire.reshape(-1).view(torch.uint8))
                try:
                    register(task, wires[-1], 0, _nbytes(tensor), peer)
                except Exception as error:  # say it in Megatron's terms
                    sending = submitted is self._sends
                    raise _refusal(f"ReshardCopyService: {_described(task, sending, peer)}: "
                                   f"{error}", [task]) from error
        svc.schedule()
        self.schedules += 1
        self._scheduled, self._scheduled_views = scheduled, views
        # Later refits copy into these tensors, so they say where the runs go.
        self._on_gpu = any(w.is_cuda for wires in scheduled for w in wires)


def transport_for_tensor_devices(devices_by_rank: List[List[str]]) -> str:
    """The transport for a refit whose rank ``r`` hands over tensors on the devices
    ``devices_by_rank[r]`` (torch device types): "host" where they are all CPU tensors, "auto"
    where none is. A refit with CPU tensors on some ranks and GPU tensors on others has no
    transport that moves both: refused on every rank, naming them."""
    cpu = [r for r, kinds in enumerate(devices_by_rank) if "cpu" in kinds]
    other = {r: [k for k in kinds if k != "cpu"] for r, kinds in enumerate(devices_by_rank)}
    other = {r: kinds for r, kinds in other.items() if kinds}
    if cpu and other:
        others = ", ".join(f"rank {r}: {'/'.join(kinds)}" for r, kinds in sorted(other.items()))
        raise _refusal(f"ReshardCopyService: rank(s) {', '.join(map(str, cpu))} hand over CPU "
                       f"tensors and others GPU tensors ({others}); one refit moves tensors of "
                       "one kind (CPU tensors on the host transport, GPU tensors on the GPU "
                       "transports): move them to the same kind of device, or give each kind "
                       "its own service")
    return "host" if cpu else "auto"


def _described(task: int, sending: bool, peer: int) -> str:
    """A submitted tensor as Megatron's caller knows it (its task id, or its place in order)."""
    what = f"the tensor {'sent to' if sending else 'received from'} rank {peer}"
    if task & _IMPLICIT_TASK:
        return f"{what} without a task id, number {(task & ((1 << _PAIR_BITS) - 1)) + 1} of " \
            "that pair"
    index = task & ((1 << _SUB_BITS) - 1)
    return f"{what} under task id {task >> _SUB_BITS}" + (
        f" (number {index + 1} under that id)" if index else "")


def _nbytes(tensor: Any) -> int:
    return tensor.nbytes


def _copy_all(torch: Any, wires: List[Any], views: List[Any], tensors: List[Any],
              into_wires: bool) -> None:
    """The bytes of each of ``tensors`` into its registered wire (``into_wires``), or back out of
    it, skipping those that are their wire. Megatron hands over new temporaries every refit, and
    a MoE refit has thousands: the copies go through ``torch._foreach_copy_``, between each tensor
    and the view of its wire with its dtype and shape (``views``, made when it was registered), or
    a byte view where a tensor of another dtype or shape but as many bytes came instead. On a GPU
    PyTorch batches a list of contiguous tensors of one dtype into a few kernels (a ``copy_`` a
    tensor launches one copy each), so the pairs go in lists by dtype, strided ones apart."""
    groups: dict = {}  # dtype (None: strided pairs) -> ([destinations], [sources])

    def add(destination: Any, source: Any, contiguous: bool) -> None:
        pair = groups.setdefault(destination.dtype if contiguous else None, ([], []))
        pair[0].append(destination)
        pair[1].append(source)

    for wire, view, tensor in zip(wires, views, tensors):
        contiguous = tensor.is_contiguous()
        if contiguous and tensor.data_ptr() == wire.data_ptr():
            continue  # the registered tensor itself (or a view of all of it)
        if tensor.dtype == view.dtype and tensor.shape == view.shape:
            if into_wires:
                add(view, tensor, contiguous)
            else:
                add(tensor, view, contiguous)
        elif into_wires:
            add(wire, tensor.detach().contiguous().reshape(-1).view(torch.uint8), True)
        elif contiguous:
            add(tensor.detach().reshape(-1).view(torch.uint8), wire, True)
        else:  # a strided destination of another shape: through a view of its own
            add(tensor, wire.view(tensor.dtype).view(tensor.shape), False)
    for destinations, sources in groups.values():
        _foreach_copy(torch, destinations, sources)


def _foreach_copy(torch: Any, destinations: List[Any], sources: List[Any]) -> None:
    """Each of ``sources`` into its destination, as one ``torch._foreach_copy_`` (PyTorch
    batches a list into a few kernels on a GPU)."""
    with torch.no_grad():
        if hasattr(torch, "_foreach_copy_"):
            torch._foreach_copy_(destinations, sources)
        else:  # PyTorch before 2.1
            for destination, source in zip(destinations, sources):
                destination.copy_(source)


class RemoteCopyService(CopyService):
    """reshard's copy service under the name, constructor and keywords of Megatron's NVSHMEM
    ``RemoteCopyService``: ``RemoteCopyService(group=None)``, ``init(log_level)``,
    ``register_send(task_id, src_tensor, src_pos, size, dest_pe)``, ``register_receive(task_id,
    dest_tensor, dest_pos, size, src_pe)``, ``schedule()``, ``run()``, ``clear_requests()``,
    ``finalize()``, ``my_pe``, ``n_pes``, ``device``, ``initialized``, and the request lists
    Megatron's services read (``send_requests``, ``receive_requests``: one
    ``RemoteRequest(task_id, size, peer)`` per registration until ``clear_requests()``).
    Positions and sizes are in bytes. ``group`` is a ``torch.distributed`` process group whose
    ranks are the PEs (default: the whole job)."""

    def __init__(self, transport: str = "auto", bootstrap: Any = None, group: Any = None) -> None:
        if bootstrap is None:
            import sys

            torch = sys.modules.get("torch")
            dist = getattr(torch, "distributed", None) if torch is not None else None
            if dist is not None and dist.is_available() and dist.is_initialized():
                bootstrap = group if group is not None else "torch"
            elif group is not None:
                raise _state_refusal("RemoteCopyService(group=...) needs torch.distributed "
                                     "initialised (dist.init_process_group) first")
        super().__init__(transport=transport, bootstrap=make_bootstrap(bootstrap))
        self.send_requests: List[RemoteRequest] = []
        self.receive_requests: List[RemoteRequest] = []

    def register_send(self, task_id: int, src_tensor: Any, src_pos: Optional[int] = None,
                      size: Optional[int] = None, dest_pe: Optional[int] = None,
                      **rows: Any) -> None:
        task_id = _task_id(task_id)  # refused first, as the base class refuses it
        src_pos, size, dest_pe = _whole_or_range("register_send", task_id, src_tensor, src_pos,
                                                 size, dest_pe, "dest_pe")
        super().register_send(task_id, src_tensor, src_pos, size, dest_pe, **rows)
        self.send_requests.append(RemoteRequest(task_id, int(size), int(dest_pe)))

    def register_receive(self, task_id: int, dest_tensor: Any, dest_pos: Optional[int] = None,
                         size: Optional[int] = None, src_pe: Optional[int] = None,
                         **rows: Any) -> None:
        """Receives ``size`` bytes from ``src_pe`` into ``dest_tensor`` at byte ``dest_pos``."""
        task_id = _task_id(task_id)
        dest_pos, size, src_pe = _whole_or_range("register_receive", task_id, dest_tensor,
                                                 dest_pos, size, src_pe, "src_pe")
        super().register_receive(task_id, dest_tensor, dest_pos, size, src_pe, **rows)
        self.receive_requests.append(RemoteRequest(task_id, int(size), int(src_pe)))

    def clear_requests(self) -> None:
        super().clear_requests()
        self.send_requests.clear()
        self.receive_requests.clear()


class RemoteRequest(NamedTuple):
    """One registration of a RemoteCopyService, as Megatron's request lists hold them."""

    task_id: int
    size: int  # bytes
    peer: int  # the destination PE of a send, the source PE of a receive



class StagedSwap:
    """Megatron's ``swap_model_weights`` in two steps: :meth:`stage` moves every byte while the
    target model's parameters keep their values, :meth:`commit` then switches them all at once.

        staged = StagedSwap(engine_model)                  # once: a twin of each parameter
        staged.stage(train_model, refit_method=service)    # the engine may serve meanwhile
        staged.commit()                                    # a local copy; staged.version += 1

    ``stage()`` runs Megatron's own ``swap_model_weights`` (its plan, its write-back, any copy
    service: :class:`ReshardCopyService`, Megatron's Gloo or NVSHMEM service; other keywords are
    passed on) with each parameter of ``target_model`` pointing at its twin for the call, so
    the bytes land in the twins. The parameters' own storage — which the engine's modules,
    captured CUDA graphs and any other holder of those tensors read — keeps the old values, and
    a stage that fails (a late or dead peer, a timeout, a refusal) leaves it bitwise unchanged, as
    the error says. ``commit()`` copies the twins into the parameters on the current stream (a
    device copy at memory speed, stream-ordered like any torch copy) and advances
    :attr:`version`. The twins cost one copy of this rank's target parameters
    (:attr:`staged_bytes`); a refit's write-back covers every parameter the plan writes, and
    what it does not write keeps the values of the last commit (parameters changed outside the
    swap between commits get those back at the next commit). ``target_model`` may be None (a rank
    that holds only the source, Megatron >= 0.17), as in ``swap_model_weights``. A transform
    (``transform=``, which writes its own buffers) is refused: those buffers are not staged."""

    def __init__(self, target_model: Any) -> None:
        torch = _torch()
        self._target = target_model
        modules = (list(target_model) if isinstance(target_model, (list, tuple))
                   else [] if target_model is None else [target_model])
        seen: set = set()
        self._params: List[Any] = []
        for module in modules:
            for param in module.parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    self._params.append(param)
        with torch.no_grad():
            self._twins = [param.detach().clone() for param in self._params]
        self._version = 0
        self._staged = False

    def stage(self, src_model: Any, refit_method: Any, **swap_arguments: Any) -> None:
        """Collective, as ``swap_model_weights``: moves the source's weights into the twins. The
        target parameters keep their values until :meth:`commit`."""
        if swap_arguments.get("transform") is not None:
            raise _refusal("StagedSwap.stage(transform=...): a transform writes its own buffers, "
                           "which are not staged; swap_model_weights runs it unstaged")
        from megatron.core.resharding.refit import swap_model_weights

        self._staged = False
        originals = [param.data for param in self._params]
        try:
            for param, twin in zip(self._params, self._twins):
                param.data = twin
            swap_model_weights(src_model, self._target, refit_method=refit_method,
                               **swap_arguments)
        except BaseException as error:
            if hasattr(error, "add_note"):  # Python >= 3.11
                error.add_note(f"StagedSwap.stage(): nothing was committed; the target model's "
                               f"parameters still hold version {self._version}")
            raise
        finally:
            for param, original in zip(self._params, originals):
                param.data = original
        self._staged = True

    def commit(self) -> None:
        """Copies what the last :meth:`stage` moved into the target parameters (on the current
        stream) and advances :attr:`version`. Refused where nothing is staged."""
        if not self._staged:
            raise _state_refusal("StagedSwap.commit(): nothing is staged (stage() did not "
                                 "succeed since the last commit)")
        if self._params:
            _foreach_copy(_torch(), [param.data for param in self._params], self._twins)
        self._staged = False
        self._version += 1

    @property
    def version(self) -> int:
        """How many commits this rank made: the weight version the target parameters hold."""
        return self._version

    @property
    def staged(self) -> bool:
        """Whether a stage succeeded since the last commit."""
        return self._staged

    @property
    def staged_bytes(self) -> int:
        """The twins' bytes on this rank."""
        return sum(_nbytes(twin) for twin in self._twins)
