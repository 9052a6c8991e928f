"""The copy service and the ways a job's processes find each other (its bootstrap)."""

from __future__ import annotations

import operator
import os
import socket
import sys
import warnings
from typing import Any, Optional, Sequence, Union

from . import _core
from .errors import (
    refusal as _refusal,
    state_refusal as _state_refusal,
    type_refusal as _type_refusal,
)

__all__ = ["CopyService", "make_bootstrap", "service_options", "stream_handle", "task_id"]




def _task_id(task_id: Any) -> int:
    """``task_id`` as the unsigned 64-bit id reshard keys requests by, or a clear refusal."""
    try:
        value = operator.index(task_id)
    except TypeError:
        raise _refusal(f"task id {task_id!r} is not an integer") from None
    if not 0 <= value < 1 << 64:
        raise _refusal(f"task id {value} is outside 0 .. 2**64 - 1 (task ids are unsigned 64-bit; "
                       "for an id from a name or a tuple, reshard.task_id(key) gives the same one "
                       "in every process, which Python's hash() does not)")
    return value


def task_id(key: Any) -> int:
    """A task id for ``key`` (a string, bytes, an integer or a tuple of them, e.g.
    ``("layers.0.mlp.fc1.weight", src_pe, dst_pe)``), the same in every process and every
    run: 64 bits of BLAKE2b over a canonical encoding of the key. Python's ``hash()`` differs
    between processes (strings are salted per process), so ids made with it match nothing."""
    import hashlib

    def encode(part: Any) -> bytes:
        if isinstance(part, bool):
            return b"b" + (b"1" if part else b"0")
        if isinstance(part, int):
            return b"i" + str(part).encode()
        if isinstance(part, str):
            return b"s" + part.encode("utf-8")
        if isinstance(part, bytes):
            return b"y" + part
        if isinstance(part, tuple):
            return b"(" + b"".join(len(e).to_bytes(4, "little") + e
                                   for e in map(encode, part)) + b")"
        raise _type_refusal(f"reshard.task_id takes strings, bytes, integers and tuples of them, "
                            f"not {type(part).__name__}")

    return int.from_bytes(hashlib.blake2b(encode(key), digest_size=8).digest(), "little")

StreamLike = Union[int, Any, None]


def stream_handle(stream: StreamLike) -> Optional[int]:
    """A CUDA stream as the integer ``cudaStream_t``: accepts an int, a ``torch.cuda.Stream``
    (``.cuda_stream``), a CuPy stream (``.ptr``) or None."""
    if stream is None or isinstance(stream, int):
        return stream
    for attribute in ("cuda_stream", "ptr"):
        handle = getattr(stream, attribute, None)
        if isinstance(handle, int):
            return handle
    raise _type_refusal(f"cannot use {type(stream).__name__} as a CUDA stream (pass an int handle)")


def _nbytes(tensor: Any) -> Optional[int]:
    """The bytes of an array (NumPy, PyTorch, CuPy, JAX, a buffer), or None where unknown."""
    nbytes = getattr(tensor, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    numel, element_size = getattr(tensor, "numel", None), getattr(tensor, "element_size", None)
    if callable(numel) and callable(element_size):
        return int(numel()) * int(element_size())
    try:
        return memoryview(tensor).nbytes
    except TypeError:
        return None


def _whole_or_range(name: str, task_id: int, tensor: Any, pos: Any, size: Any, pe: Any,
                    pe_name: str) -> tuple:
    """(position, size, PE): a byte range as given, or the whole tensor where only the PE is
    given (third positional argument or the keyword)."""
    if size is not None and pe is not None:
        return pos if pos is not None else 0, size, pe
    if size is None and (pe is None) != (pos is None):
        whole = _nbytes(tensor)
        if whole is None:
            raise _refusal(f"{name} of task {task_id}: cannot tell the size of a "
                           f"{type(tensor).__name__}; pass the position and size in bytes",
                           [task_id])
        return 0, whole, pe if pe is not None else pos
    raise _refusal(f"{name} of task {task_id}: pass ({'tensor'}, {pe_name}) for the whole tensor, "
                   f"or (tensor, position, size, {pe_name}) in bytes", [task_id])


def _rendezvous_host() -> str:
    """Where rank 0 listens when the bootstrap is built from an existing communicator: the
    torchrun master address when set, else this machine's address."""
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"]
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _from_process_group(group: Any, device: Optional[int]) -> "_core.Bootstrap":
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise _state_refusal("bootstrap='torch' needs torch.distributed initialised "
                             "(dist.init_process_group) first")
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    box = [_core.make_unique_id(_rendezvous_host()) if rank == 0 else None]
    # group=None is the default group, whose rank 0 is global rank 0.
    root = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(box, src=root, group=group)
    host, port = box[0].rsplit(":", 1)
    return _core.tcp_bootstrap(host, int(port), rank, size, _local_rank(rank, device))


def _from_mpi(comm: Any, device: Optional[int]) -> "_core.Bootstrap":
    rank, size = comm.Get_rank(), comm.Get_size()
    unique_id = comm.bcast(_core.make_unique_id(_rendezvous_host()) if rank == 0 else None, root=0)
    host, port = unique_id.rsplit(":", 1)
    if device is None:
        from mpi4py import MPI

        device = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    return _core.tcp_bootstrap(host, int(port), rank, size, device)


def _deprecated_property(name: str) -> None:
    warnings.warn(f"CopyService.{name} is deprecated and goes in the next release: it says how "
                  "the transport works inside, which reshard's executor asks itself",
                  DeprecationWarning, stacklevel=3)


def _local_rank(rank: int, device: Optional[int]) -> int:
    if device is not None:
        return device
    if os.environ.get("LOCAL_RANK"):
        return int(os.environ["LOCAL_RANK"])
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return torch.cuda.current_device()
    return rank


def make_bootstrap(
    source: Any = None,
    *,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    device: Optional[int] = None,
) -> "_core.Bootstrap":
    """How the job's processes find each other.

    ``source`` may be:

    * ``None``: torchrun variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
      ``MASTER_PORT``) when set, MPI when started by an MPI launcher, a single process otherwise;
    * a ``torch.distributed`` process group (or ``"torch"`` for the default one);
    * an ``mpi4py`` communicator;
    * an address ``"host:port"`` where rank 0 listens, with ``rank`` and ``world_size``.

    ``device`` is this process's CUDA device (by default the local rank).
    """
    if isinstance(source, _core.Bootstrap):
        return source
    if source is None:
        # The device is the service's option (CopyService(device=...)), not the process's: a
        # RESHARD_DEVICE set here would hold the first service's device for every later one.
        return _core.default_bootstrap()
    if isinstance(source, str) and source != "torch":
        if rank is None or world_size is None:
            raise _refusal("an address bootstrap needs rank= and world_size=")
        host, _, port = source.rpartition(":")
        if not host or not port.isdigit():
            raise _refusal(f"bootstrap address {source!r} is not of the form host:port")
        return _core.tcp_bootstrap(host, int(port), rank, world_size, _local_rank(rank, device))
    if hasattr(source, "Get_rank") and hasattr(source, "bcast"):
        return _from_mpi(source, device)
    if source == "torch":
        return _from_process_group(None, device)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(source, torch.distributed.ProcessGroup):
        return _from_process_group(source, device)
    raise _type_refusal(
        f"cannot bootstrap from {type(source).__name__}: pass None, a torch.distributed process "
        "group, an mpi4py communicator or a 'host:port' address"
    )


_OPTION_GROUPS = ("host", "cuda", "nccl", "nvshmem", "advanced", "debug")
_BYTE_FIELDS = {"chunk_bytes", "staging_bytes", "ce_min_bytes", "bytes_per_cta",
                "cuda_ce_min_bytes", "cuda_bytes_per_cta"}
# Settings that moved to advanced= (tuning and diagnosis), by their former "group.field" (the
# C++ options' one table); the former spelling still works for one release, with a warning.
_FORMER_NAMES = dict(_core.CopyServiceOptions.former_names())


def _advanced_name(group: str, field: str) -> Optional[str]:
    """The advanced= name of a setting given under its former group, or None where it has none."""
    moved = _FORMER_NAMES.get(f"{group}.{field}")
    return moved.split(".", 1)[1] if moved else None


def _fields(options: Any) -> list:
    return sorted(name for name in dir(options)
                  if not name.startswith("_")
                  and name not in ("from_environment", "validate", "with_former_names_applied",
                                   "former_names"))


def _set(target: Any, name: str, value: Any, where: str) -> None:
    if name not in _fields(target):
        raise _type_refusal(f"{where}: unknown setting {name!r} (settings: "
                            f"{', '.join(_fields(target))})")
    if name in _BYTE_FIELDS and isinstance(value, str):
        value = _core.parse_bytes(value)
    try:
        setattr(target, name, value)
    except TypeError:
        raise _type_refusal(f"{where}: {name}={value!r} is not a "
                            f"{type(getattr(target, name)).__name__}") from None


def service_options(**settings: Any) -> "_core.CopyServiceOptions":
    """The environment's settings (``RESHARD_*``) with ``settings`` applied, checked: what
    :class:`CopyService` takes as keywords, e.g. ``service_options(timeout=5, cuda={"engine":
    "sm"})``."""
    options = _core.CopyServiceOptions.from_environment()
    for name, value in settings.items():
        if name in _OPTION_GROUPS:
            if not isinstance(value, dict):
                raise _type_refusal(f"CopyService({name}=...) takes a dict of {name} settings, "
                                    f"e.g. {name}={{{_fields(getattr(options, name))[0]!r}: ...}}")
            group = getattr(options, name)
            advanced = options.advanced
            for field, field_value in value.items():
                moved = _advanced_name(name, field)
                if moved is not None and moved in _fields(advanced):
                    warnings.warn(f"CopyService({name}={{{field!r}: ...}}) is deprecated and goes "
                                  f"in the next release: use advanced={{{moved!r}: ...}}",
                                  DeprecationWarning, stacklevel=3)
                    _set(advanced, moved, field_value, f"CopyService({name}=...)")
                else:
                    _set(group, field, field_value, f"CopyService({name}=...)")
            setattr(options, name, group)
            if name != "advanced":
                setattr(options, "advanced", advanced)
        else:
            _set(options, name, value, "CopyService()")
    options.validate()
    return options


class CopyService:
    """Moves registered byte ranges between the job's processes (PEs).

    >>> svc = CopyService(transport="host")    # CPU arrays; "auto": GPU transports where all PEs have GPUs
    >>> svc.init(log_level="INFO")
    >>> svc.register_send(task_id, src_tensor, src_pos, size, dest_pe)  # bytes
    >>> svc.register_receive(task_id, dst_tensor, dst_pos, size, src_pe)
    >>> svc.schedule(); svc.run(); svc.run()
    >>> svc.clear_requests(); svc.finalize()

    ``transport`` is ``"auto"``, ``"host"``, ``"cuda"``, ``"nvshmem"`` or ``"nccl"``; a
    transport named here is the one used, and ``"auto"`` (the default) takes
    ``RESHARD_TRANSPORT`` where it is set; ``bootstrap`` is anything :func:`make_bootstrap`
    accepts. Registered tensors are kept alive by the service until ``clear_requests()`` or
    ``finalize()``.

    Every other setting is a keyword, with the matching ``RESHARD_*`` variable as its default
    (C++: ``CopyServiceOptions``): ``timeout`` (seconds a wait on PEs that have all arrived may
    last: a stalled transfer), ``arrival_timeout`` (seconds ``schedule()`` and ``run()`` wait for a
    PE that has not begun them yet, 600 by default), ``verify``, ``chunk_bytes``,
    ``log_level``, ``node_size``, ``inter_node_transport``, one dict per transport:
    ``host={"staging_bytes": ...}``, ``cuda={"engine": "sm", "same_device": "delegate"}``,
    ``nccl={"nonblocking": False}``, ``nvshmem={"staging_bytes": "1GiB", "waits": "stream"}``,
    and one for tuning and diagnosis, which a refit needs none of:
    ``advanced={"step_timing": True, "cuda_ctas_per_peer": 32, ...}`` (``debug=`` is its former
    name, and ``cuda=``'s ``ce_min_bytes``, ``ctas_per_peer``, ``bytes_per_cta`` and ``nccl=``'s
    ``group_spans`` moved there: both still work, with a warning). Byte counts take integers or
    strings such as ``"64KiB"``. ``device`` is this PE's CUDA device (default: the local rank).
    Two services in one process may differ in any of them; a name or value reshard does not
    know is refused here, naming it.

    >>> svc = CopyService("cuda", timeout=10, cuda={"engine": "ce"})
    """

    def __init__(
        self,
        transport: str = "auto",
        bootstrap: Any = None,
        *,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        device: Optional[int] = None,
        **settings: Any,
    ) -> None:
        if device is not None:
            settings["device"] = device
        options = service_options(**settings) if settings else None
        self._bootstrap = make_bootstrap(bootstrap, rank=rank, world_size=world_size,
                                         device=device if bootstrap is not None else None)
        self._service = _core.CopyService(transport, self._bootstrap, options)
        self._registered: list = []
        # The tensors of the last refit (execute_reshard_plan), which rerun_reshard_plan writes
        # and reads again without being given them.
        self._refit_tensors: list = []
        # execute_reshard_plan's record of its last call's dicts (key, TensorSnapshot), which a
        # call handing over the same tensors again is compared with in one pass.
        self._prepared_refit: Optional[tuple] = None

    def _choose_transport(self, transport: str) -> None:
        """Before init(): sets up ``transport`` instead of the one asked for at construction
        (``"auto"``: ``RESHARD_TRANSPORT`` where set), on the same bootstrap and settings."""
        if self._service.initialized:
            raise _state_refusal("_choose_transport() after init()")
        self._service = _core.CopyService(transport, self._bootstrap, self._service.options)

    def init(self, log_level: Optional[str] = None) -> "CopyService":
        """Collective: sets up the transport. Logs at ``log_level`` where given (overridden by
        ``RESHARD_LOG_LEVEL``), else at the service's ``log_level`` setting."""
        if log_level is None:
            self._service.init()
        else:
            self._service.init(log_level)
        return self

    @property
    def options(self) -> "_core.CopyServiceOptions":
        """The settings this service runs with (a copy)."""
        return self._service.options

    @property
    def my_pe(self) -> int:
        return self._service.my_pe

    @property
    def n_pes(self) -> int:
        return self._service.n_pes

    @property
    def device(self) -> int:
        """CUDA device of this PE, -1 on the host transport."""
        return self._service.device

    @property
    def initialized(self) -> bool:
        return self._service.initialized

    @property
    def transport(self) -> str:
        """The transport in use after init(): "host", "cuda", "nvshmem" or "nccl"."""
        return self._service.transport_name

    @property
    def moves_rows_in_place(self) -> bool:
        """Deprecated (how the transport works inside; the executor asks it itself): whether the
        transport copies strided ranges (``rows=``) row by row in place (host, CUDA, NVSHMEM);
        NCCL sends each row as a message of its own."""
        _deprecated_property("moves_rows_in_place")
        return self._service.moves_rows_in_place

    @property
    def waits_in_stream_front_end(self) -> bool:
        """Deprecated (how the transport works inside): whether the transport waits for its
        peers in its stream's front end rather than in kernels, as the GPU transports do where
        processes share a GPU without MPS. Work beside a GPU transport belongs on its stream
        either way."""
        _deprecated_property("waits_in_stream_front_end")
        return self._service.waits_in_stream_front_end

    def register_send(self, task_id: int, src_tensor: Any, src_pos: Optional[int] = None,
                      size: Optional[int] = None, dest_pe: Optional[int] = None, *,
                      rows: Sequence[int] = (), pitches: Sequence[int] = ()) -> None:
        """Sends ``size`` bytes of ``src_tensor`` from byte ``src_pos`` to ``dest_pe``; or, as
        ``register_send(task_id, tensor, dest_pe)``, the whole tensor (every byte: no count of
        elements taken for bytes).

        With ``rows`` (outer extents) and ``pitches`` (their strides in bytes), sends rows of
        ``size`` bytes each, in place: a column block of a row-major matrix is
        ``rows=(n_rows,), pitches=(bytes_per_matrix_row,)``. The receiver may cut the rows
        differently; the total bytes must agree.
        """
        task_id = _task_id(task_id)
        src_pos, size, dest_pe = _whole_or_range("register_send", task_id, src_tensor, src_pos,
                                                 size, dest_pe, "dest_pe")
        self._call(self._service.register_send, "register_send", task_id, src_tensor, src_pos,
                   size, dest_pe, rows, pitches)
        self._registered.append(src_tensor)

    def register_receive(self, task_id: int, dst_tensor: Any, dst_pos: Optional[int] = None,
                         size: Optional[int] = None, src_pe: Optional[int] = None, *,
                         rows: Sequence[int] = (), pitches: Sequence[int] = ()) -> None:
        """Receives ``size`` bytes from ``src_pe`` into ``dst_tensor`` at byte ``dst_pos``
        (or rows of ``size`` bytes, as ``register_send`` describes); or, as
        ``register_receive(task_id, tensor, src_pe)``, into the whole tensor."""
        task_id = _task_id(task_id)
        dst_pos, size, src_pe = _whole_or_range("register_receive", task_id, dst_tensor, dst_pos,
                                                size, src_pe, "src_pe")
        flags = getattr(dst_tensor, "flags", None)
        if flags is not None and getattr(flags, "writeable", True) is False:
            raise _refusal(f"register_receive of task {task_id}: the destination array is "
                           "read-only, and reshard writes into it in place: pass a writable "
                           "array", [task_id])
        self._call(self._service.register_receive, "register_receive", task_id, dst_tensor,
                   dst_pos, size, src_pe, rows, pitches)
        self._registered.append(dst_tensor)

    @staticmethod
    def _call(function: Any, name: str, task_id: int, tensor: Any, pos: Any, size: Any,
              pe: Any, rows: Sequence[int] = (), pitches: Sequence[int] = ()) -> None:
        try:
            function(task_id, tensor, pos, size, pe, list(rows), list(pitches))
        except TypeError:
            # nanobind's own message lists signatures; say which argument does not fit.
            checked = [("position", pos), ("size", size), ("PE", pe)]
            checked += [("row extent", r) for r in rows] + [("pitch", p) for p in pitches]
            for what, value in checked:
                try:
                    if operator.index(value) < 0:
                        raise ValueError
                except (TypeError, ValueError):
                    raise _refusal(f"{name} of task {task_id}: the {what} {value!r} is not a "
                                   "non-negative integer", [task_id]) from None
            raise  # arrays are read by the binding, which names the task where one is not

    def all_gather(self, data: bytes) -> list:
        """Collective: every PE's ``data``, in PE order, over the service's bootstrap (for small
        agreements between PEs, e.g. whether a schedule can be reused)."""
        return self._bootstrap.all_gather(bytes(data))

    def _meet(self, data: bytes, call: str) -> list:
        """The all-gather that opens the collective call ``call`` of a layer over the service (the
        Megatron adapter's refit): waits ``arrival_timeout`` for PEs that have not come, and
        fails on every PE alike (``retryable``), naming the late PEs and ``call``."""
        return self._service._meet(bytes(data), call)

    def schedule(self) -> "_core.ScheduleReport":
        """Collective: validates every request on every PE (before any byte moves) and plans."""
        return self._service.schedule()

    def run(self, stream: StreamLike = None) -> None:
        """Moves the registered bytes. Without a stream it returns when this PE's sends were read
        and its receives landed; with a CUDA stream (int, torch or CuPy stream) it is queued there
        and returns at once. PyTorch's default stream (handle 0) counts as no stream: the run
        then starts after the work queued there and is waited for.

        On the host transport, a run given up on a peer that is late or stalled but alive raises
        an error saying the service is usable: run again on every PE; the next run meets every
        PE first and moves every byte again."""
        self._service.run(stream_handle(stream))

    def set_phase(self, phase: int) -> None:
        """Requests registered from now on belong to ``phase`` (0 until set): one schedule in
        parts that run one after the other, e.g. a refit streamed through staging memory every
        part reuses. A task's send and receive must be in the same phase; receives of different
        phases may overlap. run() runs every phase in order."""
        self._service.set_phase(operator.index(phase))

    @property
    def phases(self) -> int:
        """After schedule(): how many phases the schedule has."""
        return self._service.phases

    def run_phase(self, phase: int, stream: StreamLike = None) -> None:
        """Runs one phase, as run() runs them all. Every PE runs the same phases in the same
        order, each one even where it has nothing to move on this PE."""
        self._service.run_phase(operator.index(phase), stream_handle(stream))

    def synchronize(self) -> None:
        """Waits for every queued run and reports a device-side failure, if any."""
        self._service.synchronize()

    @property
    def verify(self) -> bool:
        """Verify mode: after every run() each PE checksums what it sent and received and one
        all-gather compares them; a mismatch raises ReshardError (code "integrity") on every PE,
        naming the tasks. GPU ranges are read through host memory, and run(stream) waits for
        the run before checking. Every PE must set the same. Also RESHARD_VERIFY=1."""
        return self._service.verify

    @verify.setter
    def verify(self, on: bool) -> None:
        self._service.verify = bool(on)

    def clear_requests(self) -> None:
        """Forgets requests and plan; the service stays initialised."""
        self._service.clear_requests()
        self._registered.clear()
        self._refit_tensors.clear()
        self._prepared_refit = None

    def finalize(self) -> None:
        """Releases everything; safe to call twice."""
        self._service.finalize()
        self._registered.clear()
        self._refit_tensors.clear()
        self._prepared_refit = None

    def _hold_refit_tensors(self, tensors: Any, succeeded: bool) -> None:
        # A refit that failed part way may have prepared with its tensors or kept the last ones:
        # both stay held until a refit succeeds, and a failed call's tensors replace the last
        # failed call's (a loop of refused calls holds one set, not every set it was given).
        if succeeded:
            self._refit_tensors = [tensors]
        else:
            self._refit_tensors = self._refit_tensors[:1] + [tensors]

    def __enter__(self) -> "CopyService":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.finalize()

    @property
    def core(self) -> "_core.CopyService":
        """The underlying C++ service (what execute_reshard_plan runs on)."""
        return self._service
