"""Which elements of a parameter each rank of a device mesh holds, as PyTorch places them.

Pure arithmetic over index runs: no process group, no tensor. Along each tensor dimension a rank
holds a sequence of global indices (in the order its local tensor stores them), kept as runs
``(start, length)``; the rank's blocks are the products of its runs over the dimensions.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple
from ..errors import refusal as _refusal

Runs = List[Tuple[int, int]]
Piece = Tuple[List[int], List[int], List[int]]  # (global offset, extent, offset in the local tensor)


@dataclass(frozen=True)
class Placement:
    """One mesh dimension's placement: ``kind`` is "shard", "replicate" or "partial"."""

    kind: str
    dim: int = 0
    split_factor: int = 1  # > 1: PyTorch's _StridedShard

    def __str__(self) -> str:
        if self.kind == "shard":
            return f"_StridedShard({self.dim}, sf={self.split_factor})" if self.split_factor > 1 \
                else f"Shard({self.dim})"
        return "Replicate()" if self.kind == "replicate" else "Partial()"


_SHARD = re.compile(r"^\s*(?:S|Shard)\(\s*(-?\d+)\s*\)\s*$")
_REPLICATE = re.compile(r"^\s*(?:R|Replicate\(\s*\))\s*$")


def placement_of(value: Any, ndim: int) -> Placement:
    """A PyTorch placement (``Shard(d)``, ``_StridedShard``, ``Replicate()``, ``Partial``) or its
    short text (``"S(0)"``, ``"Shard(1)"``, ``"R"``, ``"Replicate()"``), with a negative dim
    counted from the end."""
    if isinstance(value, Placement):
        return value
    if isinstance(value, str):
        match = _SHARD.match(value)
        if match:
            return Placement("shard", _dim(int(match.group(1)), ndim, value))
        if _REPLICATE.match(value):
            return Placement("replicate")
        raise _refusal(f"placement {value!r} is not one of 'S(<dim>)', 'Shard(<dim>)', 'R', "
                       "'Replicate()'")
    kind = type(value).__name__
    if hasattr(value, "is_partial") and value.is_partial():
        return Placement("partial")
    if hasattr(value, "is_replicate") and value.is_replicate():
        return Placement("replicate")
    if hasattr(value, "dim") and (hasattr(value, "is_shard") or "Shard" in kind):
        split = int(getattr(value, "split_factor", 1))
        return Placement("shard", _dim(int(value.dim), ndim, value), split)
    raise _refusal(f"placement {value!r} ({kind}) is not a Shard, _StridedShard, Replicate or "
                   "Partial")


def _dim(dim: int, ndim: int, what: Any) -> int:
    if not -ndim <= dim < ndim:
        raise _refusal(f"placement {what} shards dim {dim} of a {ndim}-dimensional tensor")
    return dim % ndim


def shard_order(placements: Sequence[Placement], mesh_shape: Sequence[int]) -> List[List[int]]:
    """For each tensor dimension, the mesh dimensions that shard it, in the order they apply.

    Plain ``Shard`` placements apply left to right. A ``_StridedShard(d, split_factor)`` says the
    mesh dimension applies after others that shard the same tensor dimension with a product of
    sizes ``split_factor`` (FSDP2 over a tensor-parallel dim: the TP mesh dim first), decoded as
    PyTorch decodes it, right to left."""
    ndim = 1 + max((p.dim for p in placements if p.kind == "shard"), default=-1)
    order: List[List[int]] = [[] for _ in range(ndim)]
    if not any(p.kind == "shard" and p.split_factor > 1 for p in placements):
        for mesh_dim, p in enumerate(placements):
            if p.kind == "shard":
                order[p.dim].append(mesh_dim)
        return order
    for mesh_dim in reversed(range(len(placements))):
        p = placements[mesh_dim]
        if p.kind != "shard":
            continue
        dims = order[p.dim]
        accumulated = 1
        for position in range(len(dims) + 1):
            if accumulated == p.split_factor:
                dims.insert(position, mesh_dim)
                break
            if position < len(dims):
                accumulated *= mesh_shape[dims[position]]
        else:
            raise _refusal(f"placements ({', '.join(map(str, placements))}) on a mesh of shape "
                           f"{list(mesh_shape)}: split factor {p.split_factor} of mesh dim "
                           f"{mesh_dim} matches no order of the mesh dims sharding dim {p.dim}")
    return order


def _take(runs: Runs, lo: int, hi: int) -> Runs:
    """Elements [lo, hi) of the sequence the runs spell."""
    out: Runs = []
    at = 0
    for start, length in runs:
        a, b = max(lo, at), min(hi, at + length)
        if a < b:
            out.append((start + a - at, b - a))
        at += length
    return out


def _length(runs: Runs) -> int:
    return sum(length for _, length in runs)


def _chunk(runs: Runs, chunks: int, index: int) -> Runs:
    """``torch.chunk(x, chunks)[index]`` of the sequence (empty where torch makes fewer chunks):
    chunks of ceil(n / chunks), the last ones shorter or empty."""
    total = _length(runs)
    size = -(-total // chunks) if total else 0
    return _take(runs, min(index * size, total), min((index + 1) * size, total))


def _merge(runs: Runs) -> Runs:
    merged: Runs = []
    for start, length in runs:
        if length == 0:
            continue
        if merged and merged[-1][0] + merged[-1][1] == start:
            merged[-1] = (merged[-1][0], merged[-1][1] + length)
        else:
            merged.append((start, length))
    return merged


def holdings(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement],
             coordinate: Sequence[int], strided_as_order: bool = True
             ) -> Tuple[List[int], List[Piece]]:
    """The local shape and blocks of the rank at ``coordinate`` of the mesh.

    ``strided_as_order=False`` reads ``_StridedShard`` literally, as PyTorch's view operations
    produce it: the dimension split into ``split_factor`` chunks, each of those into ``mesh size``
    chunks, the rank taking its chunk of each."""
    runs: List[Runs] = [[(0, extent)] for extent in shape]
    if strided_as_order:
        for dim, mesh_dims in enumerate(shard_order(placements, mesh_shape)):
            for mesh_dim in mesh_dims:
                runs[dim] = _chunk(runs[dim], mesh_shape[mesh_dim], coordinate[mesh_dim])
    else:
        for mesh_dim, p in enumerate(placements):
            if p.kind != "shard":
                continue
            n, factor, c = mesh_shape[mesh_dim], p.split_factor, coordinate[mesh_dim]
            runs[p.dim] = [run for j in range(factor)
                           for run in _chunk(_chunk(runs[p.dim], factor, j), n, c)]
    runs = [_merge(r) for r in runs]
    local_shape = [_length(r) for r in runs]
    pieces: List[Piece] = []
    if any(extent == 0 for extent in local_shape):
        return local_shape, pieces
    starts = []
    for r in runs:
        at, positions = 0, []
        for _, length in r:
            positions.append(at)
            at += length
        starts.append(positions)
    for choice in itertools.product(*(range(len(r)) for r in runs)):
        pieces.append(([runs[d][i][0] for d, i in enumerate(choice)],
                       [runs[d][i][1] for d, i in enumerate(choice)],
                       [starts[d][i] for d, i in enumerate(choice)]))
    return local_shape, pieces


def mesh_coordinates(ranks: Sequence[Any]) -> Tuple[List[int], List[Tuple[int, Tuple[int, ...]]]]:
    """A mesh given as nested lists (or an array) of ranks: its shape and each (rank, coordinate)."""
    shape: List[int] = []
    level: Any = ranks
    while isinstance(level, (list, tuple)):
        shape.append(len(level))
        if not level:
            raise _refusal("a device mesh needs at least one rank in every dimension")
        level = level[0]
    entries = []
    for coordinate in itertools.product(*(range(n) for n in shape)):
        value: Any = ranks
        for i in coordinate:
            if not isinstance(value, (list, tuple)) or len(value) <= i:
                raise _refusal(f"device mesh {ranks!r} is not rectangular")
            value = value[i]
        if isinstance(value, (list, tuple)):
            raise _refusal(f"device mesh {ranks!r} is not rectangular")
        entries.append((int(value), coordinate))
    seen = [rank for rank, _ in entries]
    if len(set(seen)) != len(seen):
        raise _refusal(f"device mesh {ranks!r} names a rank twice")
    return shape, entries


def describe_placements(placements: Optional[Sequence[Placement]]) -> str:
    return "(" + ", ".join(str(p) for p in placements or ()) + ")"
