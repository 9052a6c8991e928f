"""Refits between this rank's PyTorch state dicts: what each rank holds, agreed by all ranks,
turned into the planner's two layouts, bound once.

Every rank describes its own entries (a DTensor's mesh and placements, a declared mesh, or
explicit blocks); one all-gather gives every rank every description, and every rank then derives
the same layouts, finds the same problems and raises the same error, before any byte moves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from .. import _core
from ..copy_service import CopyService
from ..tensors import LocalTensor
from ..refit import BoundRefit, GroupNumbers, name_groups
from .placements import Placement, describe_placements, holdings, mesh_coordinates, placement_of
from ..errors import refusal as _refusal, state_refusal as _state_refusal

SOURCE, DESTINATION = "source", "destination"


@dataclass
class MeshShard:
    """This rank's local tensor of a parameter that lies over a device mesh as ``placements``
    say, for tensors that are not DTensors (an inference engine's weights, say).

    ``mesh`` is a ``DeviceMesh`` or the global ranks as nested lists (``[[0, 1], [2, 3]]``: 2-D);
    ``placements`` one per mesh dimension, PyTorch's (``Shard(0)``, ``Replicate()``) or their
    short text (``"S(0)"``, ``"R"``). ``shape`` is the parameter's global shape: a destination
    takes its source's where omitted, a source assumes even shards. ``scale`` and ``dtype`` as
    for :class:`reshard.LocalTensor` (block-scaled destinations)."""

    local: Any
    mesh: Any
    placements: Sequence[Any]
    shape: Optional[Sequence[int]] = None
    scale: Any = None
    dtype: Optional[str] = None


@dataclass
class BoxShard:
    """This rank's local tensor of a parameter given as blocks of the global ``shape``: the
    whole local tensor at ``offset``, or ``boxes`` of ``(offset, extent, local_offset)`` (where
    each block sits in the local tensor). Ranks holding the same block are replicas."""

    local: Any
    shape: Sequence[int]
    offset: Optional[Sequence[int]] = None
    boxes: Optional[Sequence[Tuple[Sequence[int], Sequence[int], Sequence[int]]]] = None
    scale: Any = None
    dtype: Optional[str] = None


@dataclass(frozen=True)
class Fused:
    """A destination that stores several sources one after the other along ``dim`` of each
    rank's local tensor, as inference engines store ``qkv_proj`` (q, k, v) and ``gate_up_proj``:
    each source is laid out by the destination's mesh and placements on its own, and its local
    block lands in its own slice of the local tensor."""

    sources: Tuple[str, ...]
    dim: int = 0

    def __init__(self, sources: Sequence[str], dim: int = 0):
        if isinstance(sources, str) or not sources:
            raise _refusal("Fused(sources) takes a list of one or more source names")
        object.__setattr__(self, "sources", tuple(sources))
        object.__setattr__(self, "dim", int(dim))


NameMap = Mapping[str, Union[str, Fused]]


@dataclass
class _Record:
    """What one rank says about one of its entries; sent to every rank."""

    side: str
    name: str
    rank: int  # the PE
    kind: str  # "DTensor", "MeshShard", "BoxShard"
    dtype: str
    local_shape: List[int]
    shape: Optional[List[int]] = None
    mesh: Optional[List[int]] = None  # PEs, row-major
    mesh_shape: Optional[List[int]] = None
    placements: Optional[List[Placement]] = None
    strided_as_order: bool = True
    boxes: Optional[List[Tuple[List[int], List[int], List[int]]]] = None
    problem: Optional[str] = None

    def where(self) -> str:
        if self.mesh is None:
            return "explicit blocks"
        return (f"mesh {_nested(self.mesh, self.mesh_shape)} with "
                f"{describe_placements(self.placements)}")

    def agreement_key(self) -> tuple:
        return (self.kind, self.dtype, tuple(self.shape or ()), tuple(self.mesh or ()),
                tuple(self.mesh_shape or ()), tuple(self.placements or ()),
                self.strided_as_order)


def _nested(flat: Sequence[int], shape: Sequence[int]) -> Any:
    if len(shape) <= 1:
        return list(flat)
    step = len(flat) // shape[0]
    return [_nested(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]


@dataclass
class _Entry:
    """This rank's tensor of one entry, as the executor takes it."""

    local: Any
    scale: Any = None
    dtype: Optional[str] = None

    def tensor(self) -> Any:
        if self.scale is None and self.dtype is None:
            return self.local
        return LocalTensor(self.local, scale=self.scale, dtype=self.dtype)


def _torch_dtype_name(tensor: Any) -> str:
    dtype = getattr(tensor, "dtype", None)
    return str(dtype).replace("torch.", "") if dtype is not None else "unknown"


def _is_dtensor(value: Any) -> bool:
    return type(value).__name__ == "DTensor" and hasattr(value, "placements") and \
        hasattr(value, "device_mesh")


def _shape(value: Any) -> List[int]:
    return [int(d) for d in value.shape]


def _local_view(tensor: Any) -> Any:
    """A tensor reshard may read and write in place: autograd's view of a parameter shares its
    memory but cannot be exported."""
    detach = getattr(tensor, "detach", None)
    return detach() if callable(detach) else tensor


class _PeOf:
    """Global ranks (as meshes name them) to PEs of the service (ranks of ``group``)."""

    def __init__(self, group: Any):
        import torch.distributed as dist

        self.group = group
        self.dist = dist

    def __call__(self, global_rank: int) -> int:
        if self.group is None:
            return int(global_rank)
        return int(self.dist.get_group_rank(self.group, int(global_rank)))


def _describe(side: str, name: str, value: Any, me: int, pe_of: _PeOf) -> Tuple[_Record, _Entry]:
    """This rank's record of one entry and the tensor it moves; a problem found here is carried
    in the record so that every rank raises it, not this one alone."""
    scale = dtype_override = None
    if isinstance(value, LocalTensor):
        value, scale, dtype_override = value.data, value.scale, value.dtype
    if _is_dtensor(value):
        mesh = value.device_mesh
        ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
        spec = getattr(value, "_spec", None)
        local = _local_view(value.to_local())
        record = _Record(side, name, me, "DTensor", _torch_dtype_name(value), _shape(local),
                         shape=_shape(value), mesh_shape=[int(d) for d in mesh.mesh.shape],
                         strided_as_order=bool(getattr(spec, "use_strided_shard_as_shard_order",
                                                       True) is not False))
        placements = value.placements
        mesh_ranks: Any = ranks
    elif isinstance(value, MeshShard):
        scale = value.scale if value.scale is not None else scale
        dtype_override = value.dtype or dtype_override
        local = _local_view(value.local)
        mesh_value = value.mesh
        if hasattr(mesh_value, "mesh") and hasattr(mesh_value, "get_coordinate"):
            mesh_value = mesh_value.mesh  # a DeviceMesh: its tensor of ranks
        if hasattr(mesh_value, "tolist"):
            mesh_value = mesh_value.tolist()
        if isinstance(mesh_value, int):
            mesh_value = [mesh_value]
        record = _Record(side, name, me, "MeshShard", _torch_dtype_name(local), _shape(local),
                         shape=None if value.shape is None else [int(d) for d in value.shape])
        try:
            mesh_shape, entries = mesh_coordinates(mesh_value)
            record.mesh_shape = mesh_shape
            mesh_ranks = [rank for rank, _ in entries]
        except (ValueError, TypeError) as error:
            record.problem = f"{side} '{name}' on rank {me}: {error}"
            return record, _Entry(local, scale, dtype_override)
        placements = value.placements
    elif isinstance(value, BoxShard):
        scale = value.scale if value.scale is not None else scale
        dtype_override = value.dtype or dtype_override
        local = _local_view(value.local)
        record = _Record(side, name, me, "BoxShard", _torch_dtype_name(local), _shape(local),
                         shape=[int(d) for d in value.shape])
        if value.boxes is not None:
            record.boxes = [([int(x) for x in o], [int(x) for x in e], [int(x) for x in a])
                            for o, e, a in value.boxes]
        else:
            offset = value.offset if value.offset is not None else [0] * len(record.local_shape)
            record.boxes = [([int(x) for x in offset], list(record.local_shape),
                             [0] * len(record.local_shape))]
        if dtype_override is not None:
            record.dtype = dtype_override
        return record, _Entry(local, scale, dtype_override)
    else:
        local = _local_view(value)
        if not hasattr(local, "shape"):
            record = _Record(side, name, me, "BoxShard", "unknown", [])
            record.problem = (f"{side} '{name}' on rank {me} is a {type(value).__name__}: pass a "
                              "DTensor, or a local tensor as MeshShard(...) or BoxShard(...)")
            return record, _Entry(local)
        # A plain tensor: the whole parameter on this rank.
        record = _Record(side, name, me, "BoxShard", _torch_dtype_name(local), _shape(local),
                         shape=_shape(local))
        record.boxes = [([0] * len(record.local_shape), list(record.local_shape),
                         [0] * len(record.local_shape))]
        if dtype_override is not None:
            record.dtype = dtype_override
        return record, _Entry(local, scale, dtype_override)
    if dtype_override is not None:
        record.dtype = dtype_override
    ndim = len(record.shape) if record.shape is not None else len(record.local_shape)
    try:
        record.placements = [placement_of(p, ndim) for p in placements]
        record.mesh = [pe_of(r) for r in mesh_ranks]
    except (ValueError, TypeError, RuntimeError) as error:
        record.problem = f"{side} '{name}' on rank {me}: {error}"
        return record, _Entry(local, scale, dtype_override)
    if len(record.placements) != len(record.mesh_shape):
        record.problem = (f"{side} '{name}': {len(record.placements)} placements for a "
                          f"{len(record.mesh_shape)}-dimensional mesh")
    for mesh_dim, p in enumerate(record.placements):
        if p.kind == "partial":
            record.problem = (f"{side} '{name}' is Partial on mesh dim {mesh_dim} of "
                              f"{record.where()}: a pending sum is not a value to move; "
                              "redistribute it to Replicate() (or Shard) first")
    return record, _Entry(local, scale, dtype_override)


@dataclass
class _Holding:
    """Where a parameter part lives on one PE: the local tensor's shape and its blocks."""

    local_shape: List[int]
    pieces: List[Tuple[List[int], List[int], List[int]]]


@dataclass
class _Agreed:
    """What every rank derives from all descriptions."""

    problems: List[str] = field(default_factory=list)
    # plan name -> (source name, destination name, part index)
    plan_names: Dict[str, Tuple[str, str, int]] = field(default_factory=dict)
    src_layout: Any = None
    dst_layout: Any = None


def _mesh_holdings(record: _Record, shape: Sequence[int]) -> Dict[int, _Holding]:
    """Every mesh PE's holding of a parameter of ``shape`` as the record places it."""
    out = {}
    coordinates = mesh_coordinates(_nested(record.mesh, record.mesh_shape))[1]
    for pe, coordinate in coordinates:
        local_shape, pieces = holdings(shape, record.mesh_shape, record.placements, coordinate,
                                       record.strided_as_order)
        out[pe] = _Holding(local_shape, pieces)
    return out


def _check_agreement(records: List[_Record], problems: List[str]) -> Optional[_Record]:
    """The description every rank gives of one entry, or None (with a problem) where they
    differ or a mesh rank gave none."""
    first = records[0]
    for other in records[1:]:
        if other.agreement_key() != first.agreement_key():
            problems.append(
                f"{first.side} '{first.name}': rank {first.rank} describes it as "
                f"{_what(first)}, rank {other.rank} as {_what(other)}")
            return None
    if first.mesh is not None:
        given = {r.rank for r in records}
        missing = [pe for pe in first.mesh if pe not in given]
        if missing:
            problems.append(f"{first.side} '{first.name}' lies on {first.where()}, but rank(s) "
                            f"{', '.join(map(str, missing))} passed no tensor for it")
            return None
        outside = sorted(given - set(first.mesh))
        if outside:
            problems.append(f"{first.side} '{first.name}' lies on {first.where()}, but rank(s) "
                            f"{', '.join(map(str, outside))} outside that mesh passed one")
            return None
    return first


def _what(record: _Record) -> str:
    shape = "" if record.shape is None else f"{record.shape} "
    return f"{record.kind} {shape}{record.dtype} on {record.where()}"


def _check_local_shape(record: _Record, holding: _Holding, problems: List[str]) -> bool:
    if record.local_shape == holding.local_shape:
        return True
    problems.append(f"{record.side} '{record.name}': rank {record.rank}'s local tensor is "
                    f"{record.local_shape}, but {record.where()} gives it {holding.local_shape}"
                    + (" (pass MeshShard(shape=...) for an uneven split)"
                       if record.kind == "MeshShard" and record.side == SOURCE else ""))
    return False


def _source_holdings(records: List[_Record], problems: List[str]
                     ) -> Optional[Tuple[List[int], str, Dict[int, _Holding]]]:
    first = _check_agreement(records, problems)
    if first is None:
        return None
    if first.mesh is None:
        shape = first.shape
        held = {r.rank: _Holding(r.local_shape, r.boxes) for r in records}
        return shape, first.dtype, held
    shape = first.shape
    if shape is None:  # a MeshShard without shape=: even shards
        shape = list(first.local_shape)
        for mesh_dim, p in enumerate(first.placements):
            if p.kind == "shard":
                shape[p.dim] *= first.mesh_shape[mesh_dim]
    held = _mesh_holdings(first, shape)
    ok = all(_check_local_shape(r, held[r.rank], problems) for r in records)
    return (shape, first.dtype, held) if ok else None


def agree(all_records: List[List[_Record]], names: Optional[NameMap], has_transform: bool,
          strict: bool, real_shapes: Optional[Mapping[str, List[int]]] = None) -> _Agreed:
    """The layouts every rank derives from every rank's records (pure: the same on every
    rank), or the problems that stop the refit. ``real_shapes``: source name -> the block of
    real values where the sides pad that parameter (see :func:`bind`)."""
    reals = dict(real_shapes or {})
    agreed = _Agreed()
    problems = agreed.problems
    by_entry: Dict[Tuple[str, str], List[_Record]] = {}
    for rank_records in all_records:
        for record in rank_records:
            if record.problem:
                problems.append(record.problem)
            by_entry.setdefault((record.side, record.name), []).append(record)
    if problems:
        return agreed

    sources: Dict[str, Tuple[List[int], str, Dict[int, _Holding]]] = {}
    for (side, name), records in sorted(by_entry.items()):
        if side == SOURCE:
            found = _source_holdings(records, problems)
            if found is not None:
                sources[name] = found
    known_sources = {name for side, name in by_entry if side == SOURCE}

    # Each destination's parts: (source name, fused dim or None).
    destinations = sorted(name for side, name in by_entry if side == DESTINATION)
    mapping = dict(names or {})
    for name in mapping:
        if (DESTINATION, name) not in by_entry:
            problems.append(f"names maps destination '{name}', which no rank passes")
    parts_of: Dict[str, Tuple[Tuple[str, ...], Optional[int]]] = {}
    for name in destinations:
        target = mapping.get(name, name)
        parts = (target.sources, target.dim) if isinstance(target, Fused) else ((target,), None)
        missing = [s for s in parts[0] if s not in known_sources]
        if missing:
            problems.append(f"destination '{name}' takes source(s) "
                            f"{', '.join(repr(s) for s in missing)}, which no rank passes"
                            + ("" if name in mapping else " (map names with names=)"))
            continue
        parts_of[name] = parts
    used = {s for parts, _ in parts_of.values() for s in parts}
    unused = sorted(known_sources - used)
    if unused and strict:
        problems.append(f"{len(unused)} source(s) no destination takes: "
                        f"{', '.join(repr(s) for s in unused[:5])}"
                        f"{' ...' if len(unused) > 5 else ''} (strict=False leaves them)")
    uses: Dict[str, int] = {}
    for parts, _ in parts_of.values():
        for s in parts:
            uses[s] = uses.get(s, 0) + 1

    src_layout, dst_layout = _core.Layout(), _core.Layout()
    for name, (parts, fused_dim) in sorted(parts_of.items()):
        record = _check_agreement(by_entry[(DESTINATION, name)], problems)
        if record is None or any(s not in sources for s in parts):
            continue
        shapes = [sources[s][0] for s in parts]
        dtypes = {sources[s][1] for s in parts}
        if fused_dim is not None:
            ndim = len(shapes[0])
            if not -ndim <= fused_dim < ndim or any(len(s) != ndim for s in shapes):
                problems.append(f"destination '{name}' fuses sources of shapes {shapes} along "
                                f"dim {fused_dim}")
                continue
            fused_dim %= ndim
            rest = {tuple(s[:fused_dim] + s[fused_dim + 1:]) for s in shapes}
            if len(rest) != 1:
                problems.append(f"destination '{name}' fuses {list(parts)} along dim "
                                f"{fused_dim}, but their shapes {shapes} differ in other dims")
                continue
            whole = list(shapes[0])
            whole[fused_dim] = sum(s[fused_dim] for s in shapes)
        else:
            whole = list(shapes[0])
        real = reals.get(parts[0]) if fused_dim is None else None
        if fused_dim is not None and any(s in reals for s in parts):
            problems.append(f"destination '{name}' fuses {list(parts)}: real_shapes= applies to "
                            "a destination that takes one source whole")
            continue
        # A padded parameter: each side's global shape is its own; the real block moves.
        dst_whole = list(record.shape) if real is not None and record.shape is not None \
            else whole
        if real is not None and not (len(real) == len(whole) == len(dst_whole) and all(
                0 <= r <= min(a, b) for r, a, b in zip(real, whole, dst_whole))):
            problems.append(f"real_shapes['{parts[0]}'] = {list(real)} does not lie inside the "
                            f"source's {whole} and the destination '{name}''s {dst_whole}")
            continue
        if record.shape is not None and record.shape != dst_whole:
            problems.append(f"destination '{name}' is {record.shape}, its source"
                            f"{'s' if len(parts) > 1 else ''} {list(parts)} "
                            f"{'fuse to' if fused_dim is not None else 'is'} {whole}"
                            + ("" if fused_dim is not None else
                               " (real_shapes= where the sides pad it differently)"))
            continue
        if not has_transform and (len(dtypes) != 1 or record.dtype not in dtypes):
            problems.append(f"destination '{name}' is {record.dtype}, its source"
                            f"{'s' if len(parts) > 1 else ''} {list(parts)} "
                            f"{'/'.join(sorted(dtypes))} (pass a transform to convert)")
            continue
        if fused_dim is not None and record.mesh is None:
            problems.append(f"destination '{name}' fuses {list(parts)}: describe it by a mesh "
                            "and placements (a DTensor or MeshShard), not by explicit blocks")
            continue
        if record.mesh is None and len(parts) == 1:
            held_parts = [{r.rank: _Holding(r.local_shape, r.boxes)
                           for r in by_entry[(DESTINATION, name)]}]
        elif real is not None:
            held_parts = [_mesh_holdings(record, dst_whole)]
        else:
            held_parts = [_mesh_holdings(record, shape) for shape in shapes]
        if fused_dim is not None:
            held_parts = _fuse(held_parts, fused_dim)
        if record.mesh is not None:
            ok = True
            for r in by_entry[(DESTINATION, name)]:
                ok = _check_local_shape(r, held_parts[0][r.rank], problems) and ok
            if not ok:
                continue
        for index, source in enumerate(parts):
            plan_name = source if uses[source] == 1 else f"{source}->{name}"
            if plan_name in agreed.plan_names:
                problems.append(f"destination '{name}' takes '{source}' twice")
                continue
            agreed.plan_names[plan_name] = (source, name, index)
            shape, dtype, src_held = sources[source]
            try:
                _add(src_layout, plan_name, shape, dtype, src_held, real)
                _add(dst_layout, plan_name, dst_whole if real is not None else shape, dtype,
                     held_parts[index], real)
            except _core.ReshardError as error:
                problems.append(f"'{source}' -> '{name}': {error}")
    agreed.src_layout, agreed.dst_layout = src_layout, dst_layout
    return agreed


def _fuse(held_parts: List[Dict[int, _Holding]], dim: int) -> List[Dict[int, _Holding]]:
    """Each part's holdings moved to its slice of the fused local tensor (parts one after the
    other along ``dim``), with the fused local shape."""
    out: List[Dict[int, _Holding]] = [{} for _ in held_parts]
    for pe in held_parts[0]:
        shapes = [held[pe].local_shape for held in held_parts]
        fused_shape = list(shapes[0])
        fused_shape[dim] = sum(s[dim] for s in shapes)
        at = 0
        for index, held in enumerate(held_parts):
            pieces = []
            for offset, extent, local_at in held[pe].pieces:
                moved = list(local_at)
                moved[dim] += at
                pieces.append((offset, extent, moved))
            out[index][pe] = _Holding(fused_shape, pieces)
            at += shapes[index][dim]
    return out


def _add(layout: Any, name: str, shape: List[int], dtype: str,
         held: Dict[int, _Holding], real: Optional[List[int]] = None) -> None:
    layout.add_param(_core.ParamSpec(name, shape, dtype, real_shape=real))
    for pe in sorted(held):
        holding = held[pe]
        layout.add_packed_shard(pe, name, holding.local_shape, holding.pieces)


def _raise_problems(problems: List[str]) -> None:
    shown = problems[:8]
    more = f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else ""
    raise _refusal("reshard.torch.bind: the ranks' state dicts do not describe one refit:\n  "
                   + "\n  ".join(shown) + more)


class StateDictRefit(BoundRefit):
    """A refit between state dicts, bound once (see :func:`bind`): ``run()`` every refit.

    ``plan`` is the plan both layouts gave; ``names`` maps each plan name to (source name,
    destination name, part of a fused destination)."""

    def __init__(self, plan: Any, src: Mapping[str, Any], dst: Mapping[str, Any],
                 service: CopyService, owns_service: bool, names: Dict[str, Tuple[str, str, int]],
                 translate: Any, **options: Any):
        self._owned_service = service if owns_service else None
        self.plan = plan
        self.names = names
        self._translate = translate
        try:
            super().__init__(plan, src, dst, service, **options)
        except BaseException:
            if owns_service:
                service.finalize()
            raise

    def update(self, src: Optional[Mapping[str, Any]] = None,
               dst: Optional[Mapping[str, Any]] = None, stream: Any = None) -> Any:
        """Gives the refit other tensors under the state dicts' names (collective; the layouts
        stay those bound: bind again for others)."""
        local_src, local_dst = self._translate(src or {}, dst or {})
        return super().update(local_src, local_dst, stream)

    def close(self) -> None:
        super().close()
        if self._owned_service is not None:
            self._owned_service.finalize()
            self._owned_service = None


def bind(src: Optional[Mapping[str, Any]], dst: Optional[Mapping[str, Any]], *,
         names: Optional[NameMap] = None, service: Optional[CopyService] = None,
         group: Any = None, transport: str = "auto", transform: Any = None,
         stream: Any = None, staging_budget: Optional[Union[int, str]] = None,
         quantize_colocated_on_sender: bool = True, strict: bool = True, staged: bool = False,
         max_staged_bytes: Optional[Union[int, str]] = None,
         groups: Any = None,
         real_shapes: Optional[Mapping[str, Sequence[int]]] = None) -> StateDictRefit:
    """Binds a refit from this rank's source state dict to this rank's destination state dict
    (collective over ``group``, default the whole ``torch.distributed`` world: every rank
    calls it, a rank holding one side or neither passing ``None`` or ``{}`` for the other).

    Values are DTensors (FSDP2, tensor parallel, both), :class:`MeshShard` (a local tensor with
    a declared mesh and placements), :class:`BoxShard` (explicit blocks) or plain tensors (the
    whole parameter). Destination names are source names unless ``names`` maps a destination
    to a source name or to :class:`Fused` sources. Every rank gathers every description, checks
    that they describe one refit (the same shape, dtype, mesh and placements on every rank of a
    mesh, every destination's sources present and of its shape and dtype, no source left over
    unless ``strict=False``) and raises the same error on every rank where not, naming the
    parameters and ranks; then plans and binds once. ``refit.run()`` then moves every byte at
    every refit.

    ``service`` is a :class:`reshard.CopyService` over the ranks of ``group`` (PE i is rank i of
    the group); by default the refit makes one (``transport``) and finalizes it on ``close()``.
    ``transform``, ``stream``, ``staging_budget``, ``quantize_colocated_on_sender``, ``staged``
    and ``max_staged_bytes`` as for :func:`reshard.bind` (``staged=True``: ``refit.stage()``
    while the engine serves, ``refit.commit()`` on each engine rank when it pauses).
    ``groups`` as for :func:`reshard.bind`, over the destination names (``"layers"``, a mapping
    of group names to destination names or patterns, or a function of a destination name):
    ``refit.run(groups=...)`` then moves only those destinations' bytes.

    ``real_shapes`` maps a source name to the block of its real values where the sides pad the
    parameter differently (a vocabulary padded to a multiple of 128 x TP by the trainer and of
    64 by the engine): each side's global shape is then its own, only the block
    ``[0, real[d])`` moves, and a destination's padding keeps what it holds.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise _state_refusal("reshard.torch.bind needs torch.distributed initialised "
                             "(dist.init_process_group) first")
    me = dist.get_rank(group)
    world = dist.get_world_size(group)
    pe_of = _PeOf(group)
    src, dst = dict(src or {}), dict(dst or {})
    records: List[_Record] = []
    entries: Dict[Tuple[str, str], _Entry] = {}
    for side, tensors in ((SOURCE, src), (DESTINATION, dst)):
        for name, value in tensors.items():
            record, entry = _describe(side, str(name), value, me, pe_of)
            records.append(record)
            entries[(side, str(name))] = entry
    mapping = _canonical_names(names)
    reals = {str(k): [int(d) for d in v] for k, v in sorted((real_shapes or {}).items())}
    gathered: List[Any] = [None] * world
    dist.all_gather_object(gathered, (records, mapping, reals), group=group)
    differing = [rank for rank, (_, theirs, _) in enumerate(gathered)
                 if theirs != gathered[0][1]]
    if differing:
        _raise_problems([f"the ranks pass different names= mappings: rank 0 "
                         f"{_show_names(gathered[0][1])}, rank {differing[0]} "
                         f"{_show_names(gathered[differing[0]][1])} (every rank passes the "
                         "same)"])
    differing = [rank for rank, (_, _, theirs) in enumerate(gathered)
                 if theirs != gathered[0][2]]
    if differing:
        _raise_problems([f"the ranks pass different real_shapes=: rank 0 {gathered[0][2]}, rank "
                         f"{differing[0]} {gathered[differing[0]][2]} (every rank passes the "
                         "same)"])
    agreed = agree([r for r, _, _ in gathered], names, transform is not None, strict, reals)
    if agreed.problems:
        _raise_problems(agreed.problems)
    plan = _core.make_reshard_plan(agreed.src_layout, agreed.dst_layout)

    def translate(new_src: Mapping[str, Any], new_dst: Mapping[str, Any]) -> tuple:
        local_src: Dict[str, Any] = {}
        local_dst: Dict[str, Any] = {}
        for plan_name, (source, destination, _) in agreed.plan_names.items():
            if source in new_src:
                local_src[plan_name] = _describe(SOURCE, source, new_src[source], me,
                                                 pe_of)[1].tensor()
            if destination in new_dst:
                local_dst[plan_name] = _describe(DESTINATION, destination,
                                                 new_dst[destination], me, pe_of)[1].tensor()
        return local_src, local_dst

    local_src: Dict[str, Any] = {}
    local_dst: Dict[str, Any] = {}
    for plan_name, (source, destination, _) in agreed.plan_names.items():
        if (SOURCE, source) in entries:
            local_src[plan_name] = entries[(SOURCE, source)].tensor()
        if (DESTINATION, destination) in entries:
            local_dst[plan_name] = entries[(DESTINATION, destination)].tensor()
    owns = service is None
    if owns:
        device = _cuda_device(local_src, local_dst)
        service = CopyService(transport, group if group is not None else "torch",
                              device=device)
    core = service.core if isinstance(service, CopyService) else service
    if not core.initialized:
        # A service of the refit's own logs warnings only (RESHARD_LOG_LEVEL overrides it).
        service.init("WARN") if owns else service.init()
    if core.my_pe != me or core.n_pes != world:
        raise _refusal(f"reshard.torch.bind: the service's PE {core.my_pe} of {core.n_pes} is "
                       f"not this rank {me} of the {world} ranks of the process group")
    if groups is not None:
        # The groups of the destinations, taken by the plan's names of them.
        destinations = [agreed.plan_names[p.name][1] for p in plan.params]
        numbers, group_names = name_groups(destinations, groups)
        groups = GroupNumbers(numbers, group_names)
    return StateDictRefit(plan, local_src, local_dst, service, owns, agreed.plan_names,
                          translate, groups=groups, transform=transform, stream=stream,
                          staging_budget=staging_budget,
                          quantize_colocated_on_sender=quantize_colocated_on_sender,
                          staged=staged, max_staged_bytes=max_staged_bytes)


def _canonical_names(names: Optional[NameMap]) -> List[tuple]:
    """``names`` as a sorted list of plain values, the same on ranks that passed the same."""
    out = []
    for destination, target in (names or {}).items():
        if isinstance(target, Fused):
            out.append((str(destination), "fused", target.sources, target.dim))
        else:
            out.append((str(destination), "name", str(target), 0))
    return sorted(out)


def _show_names(mapping: List[tuple]) -> str:
    if not mapping:
        return "none"
    shown = [f"{d!r} -> {t!r}" if kind == "name" else f"{d!r} -> Fused({list(t)}, dim={dim})"
             for d, kind, t, dim in mapping[:3]]
    return "{" + ", ".join(shown) + (" ..." if len(mapping) > 3 else "") + "}"


def _cuda_device(*maps: Mapping[str, Any]) -> Optional[int]:
    """The GPU of this rank's tensors; for a rank holding none, PyTorch's current device where
    PyTorch uses CUDA (else the service's default, the local rank)."""
    for tensors in maps:
        for value in tensors.values():
            data = value.data if isinstance(value, LocalTensor) else value
            if getattr(data, "is_cuda", False):
                return data.device.index if data.device.index is not None else 0
    import torch

    return torch.cuda.current_device() if torch.cuda.is_initialized() else None
