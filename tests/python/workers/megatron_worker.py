"""One rank of a job driving reshard through Megatron's CopyService interface (torch tensors):
every rank sends a contiguous tensor, a strided view and two fresh tensors under one task id to
its right neighbour, with and without task ids, over three refits (the later ones must not
reschedule although the two tensors are new each time, in the last refit of other shapes and
dtypes with as many bytes, one received into a strided view), checking what arrives.

    megatron_worker.py [cpu|cuda]
"""

import sys

import torch

import reshard
from reshard.megatron import ReshardCopyService


def main():
    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    svc = reshard.CopyService(transport="host" if device == "cpu" else "cuda")
    adapter = ReshardCopyService(service=svc)
    me, n = adapter.rank, adapter.world_size
    if device == "cuda":
        torch.cuda.set_device(svc.device)
    right, left = (me + 1) % n, (me - 1) % n
    # Persistent tensors, as a model's weights are: refits after the first reuse the schedule.
    plain = torch.empty(1000, dtype=torch.float32, device=device)
    matrix = torch.empty(64, 48, dtype=torch.bfloat16, device=device)
    column_block = matrix[:, 16:32]  # not contiguous
    got_plain = torch.zeros(1000, dtype=torch.float32, device=device)
    got_matrix = torch.zeros(64, 48, dtype=torch.bfloat16, device=device)
    for refit in range(3):
        plain.copy_(torch.arange(1000, dtype=torch.float32, device=device) + 1000 * me + refit)
        matrix.copy_(torch.arange(64 * 48, dtype=torch.bfloat16, device=device).reshape(64, 48)
                     + me + refit)
        got_plain.zero_()
        got_matrix.zero_()
        adapter.submit_send(plain, right, task_id=1000 * me + 1)
        adapter.submit_recv(got_plain, left, task_id=1000 * left + 1)
        adapter.submit_send(column_block, right)  # no task id: matched in submission order
        adapter.submit_recv(got_matrix[:, 0:16], left)
        # Two tensors under one task id (Megatron's MXFP8 transform sends data and scales so):
        # they travel in the order submitted.
        # The last refit hands over as many bytes in other shapes and dtypes: a float32 vector
        # sent as int32, received as a 2 x 5 matrix and into a strided 3 x 1 column.
        first = plain[:10] * 2
        adapter.submit_send(first.view(torch.int32) if refit == 2 else first, right,
                            task_id=1000 * me + 2)
        adapter.submit_send(plain[:3] * 3, right, task_id=1000 * me + 2)
        got_first = torch.zeros((2, 5) if refit == 2 else 10, dtype=torch.float32, device=device)
        got_second = (torch.zeros(3, 2, dtype=torch.float32, device=device)[:, :1] if refit == 2
                      else torch.zeros(3, dtype=torch.float32, device=device))
        adapter.submit_recv(got_first, left, task_id=1000 * left + 2)
        adapter.submit_recv(got_second, left, task_id=1000 * left + 2)
        generation = svc.core._generation
        adapter.run()
        if device == "cuda":
            torch.cuda.synchronize()
        if refit > 0 and svc.core._generation != generation:
            print(f"rank {me}: refit {refit} rescheduled", file=sys.stderr)
            return 1
        want_plain = torch.arange(1000, dtype=torch.float32, device=device) + 1000 * left + refit
        want_block = (torch.arange(64 * 48, dtype=torch.bfloat16, device=device).reshape(64, 48)
                      + left + refit)[:, 16:32]
        if not torch.equal(got_plain, want_plain) or not torch.equal(got_matrix[:, 0:16],
                                                                     want_block):
            print(f"rank {me}: refit {refit}: wrong data", file=sys.stderr)
            return 1
        if not torch.equal(got_first.reshape(-1), want_plain[:10] * 2) or not torch.equal(
                got_second.reshape(-1), want_plain[:3] * 3):
            print(f"rank {me}: refit {refit}: tensors under one task id crossed", file=sys.stderr)
            return 1
        if torch.count_nonzero(got_matrix[:, 16:]) != 0:
            print(f"rank {me}: wrote outside the receive view", file=sys.stderr)
            return 1
    adapter.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
