"""A drop-in for Megatron's resharding copy services (megatron.core.resharding.copy_services).

    from reshard.megatron import ReshardCopyService
    swap_model_weights(..., refit_method=ReshardCopyService())

Megatron submits every send and receive of a refit, then calls ``run()``; the next refit submits
the same ones again. This adapter schedules the first refit and, while the submissions stay the
same (task ids, tensors, sizes, peers), every later refit only runs: no re-planning, no barrier.
Non-contiguous tensors (strided views) go through contiguous copies made by the adapter.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from .copy_service import CopyService

__all__ = ["ReshardCopyService"]

# Task ids Megatron leaves out are numbered per (source, destination) pair in submission order,
# in a range of their own so they cannot meet an explicit id.
_IMPLICIT_TASK = 1 << 63


class ReshardCopyService:
    """Megatron's CopyService interface over a reshard :class:`CopyService`."""

    # What Megatron's refit loop asks of a copy service.
    requires_process_group_barrier = False
    supports_multiple_runs_per_plan = True

    def __init__(self, service: Optional[CopyService] = None, transport: str = "auto",
                 bootstrap: Any = "torch", log_level: str = "WARN") -> None:
        if service is None:
            service = CopyService(transport=transport, bootstrap=bootstrap)
        if not service.initialized:
            service.init(log_level)
        self.service = service
        self.rank = service.my_pe
        self.world_size = service.n_pes
        self._sends: List[Tuple[int, Any, int]] = []
        self._recvs: List[Tuple[int, Any, int]] = []
        self._scheduled: Optional[list] = None
        self._staged_sends: List[Tuple[Any, Any]] = []  # (contiguous copy, original view)
        self._staged_recvs: List[Tuple[Any, Any]] = []
        self._implicit_counts: dict = {}

    def _task(self, task_id: Optional[int], src: int, dst: int) -> int:
        if task_id is not None:
            return task_id
        index = self._implicit_counts.get((src, dst), 0)
        self._implicit_counts[(src, dst)] = index + 1
        return _IMPLICIT_TASK | (src << 42) | (dst << 21) | index

    def submit_send(self, src_tensor: Any, dest_rank: int, task_id: Optional[int] = None) -> None:
        """Registers ``src_tensor`` (all of it) to go to ``dest_rank``."""
        self._sends.append((self._task(task_id, self.rank, dest_rank), src_tensor, dest_rank))

    def submit_recv(self, dest_tensor: Any, src_rank: int, task_id: Optional[int] = None) -> None:
        """Registers ``dest_tensor`` (all of it) to be filled from ``src_rank``."""
        self._recvs.append((self._task(task_id, src_rank, self.rank), dest_tensor, src_rank))

    def _signature(self) -> list:
        def key(entries):
            return [(task, t.data_ptr(), tuple(t.shape), tuple(t.stride()), str(t.dtype), peer)
                    for task, t, peer in entries]
        return key(self._sends) + [None] + key(self._recvs)

    def _register(self) -> None:
        import torch

        svc = self.service
        svc.clear_requests()
        self._staged_sends.clear()
        self._staged_recvs.clear()
        for entries, staged, register in ((self._sends, self._staged_sends, svc.register_send),
                                          (self._recvs, self._staged_recvs,
                                           svc.register_receive)):
            for task, tensor, peer in entries:
                wire = tensor if tensor.is_contiguous() else tensor.contiguous()
                if wire is not tensor:
                    staged.append((wire, tensor))
                register(task, wire.view(-1).view(torch.uint8), 0,
                         wire.numel() * wire.element_size(), peer)
        svc.schedule()

    def run(self) -> None:
        """Moves every submitted tensor, then forgets the submissions (as Megatron expects)."""
        import torch

        signature = self._signature()
        if signature != self._scheduled:
            self._register()
            self._scheduled = signature
        for wire, view in self._staged_sends:
            wire.copy_(view)
        on_gpu = any(t.is_cuda for _, t, _ in self._sends + self._recvs)
        stream = torch.cuda.current_stream() if on_gpu else None
        self.service.run(stream)
        for wire, view in self._staged_recvs:
            view.copy_(wire)
        self._sends.clear()
        self._recvs.clear()
        self._implicit_counts.clear()

    def close(self) -> None:
        """Releases the service."""
        self.service.finalize()
