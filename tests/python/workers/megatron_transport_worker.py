"""One rank of a job whose Megatron copy service is made without a transport (``"auto"``): it is
set up at the first run(), for the tensors handed over.

    megatron_transport_worker.py cpu    every rank's tensors on the CPU: the host transport moves
                                        them (on a machine with GPUs too), bytes checked
    megatron_transport_worker.py mixed  rank 0 hands over tensors of another device (meta): every
                                        rank refuses the refit, naming the ranks, before any byte
                                        moves
"""

import sys

import torch

import reshard
from reshard.megatron import ReshardCopyService


def main():
    mode = sys.argv[1]
    adapter = ReshardCopyService()  # no torch.distributed job: bootstraps from reshard.launch
    me, n = adapter.rank, adapter.world_size
    right, left = (me + 1) % n, (me - 1) % n
    if adapter.service.initialized:
        print(f"rank {me}: the service was set up before its tensors were known", file=sys.stderr)
        return 1
    device = "meta" if mode == "mixed" and me == 0 else "cpu"
    for refit in range(2):
        sent = torch.arange(513, dtype=torch.float32, device=device) * (me + 1) + refit
        got = torch.zeros(513, dtype=torch.float32, device=device)
        adapter.submit_send(sent, right)
        adapter.submit_recv(got, left)
        try:
            adapter.run()
        except reshard.ReshardError as error:
            text = str(error)
            wanted = ("rank(s) " + ", ".join(map(str, range(1, n))) + " hand over CPU tensors",
                      "rank 0: meta")
            if mode == "mixed" and all(part in text for part in wanted):
                print(f"rank {me}: refused: {text}")
                return 0
            raise
        if mode == "mixed":
            print(f"rank {me}: a refit of CPU and meta tensors was not refused", file=sys.stderr)
            return 1
        if adapter.service.transport != "host":
            print(f"rank {me}: transport {adapter.service.transport}", file=sys.stderr)
            return 1
        want = torch.arange(513, dtype=torch.float32) * (left + 1) + refit
        if not torch.equal(got, want):
            print(f"rank {me}: refit {refit}: wrong bytes from rank {left}", file=sys.stderr)
            return 1
    print(f"rank {me}: CPU tensors moved on the host transport")
    adapter.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
