"""One PE of a job that bootstraps a certain way, then checks a ring exchange and that the GIL is
released while schedule() waits for a late peer.

    bootstrap_worker.py address PORT | torch | megatron | mpi
"""

import os
import sys
import threading
import time

import numpy as np

import reshard


def service_for(mode, argv):
    if mode == "address":
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        return reshard.CopyService("host", f"127.0.0.1:{argv[0]}", rank=rank, world_size=size)
    if mode == "torch":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        return reshard.CopyService("host", dist.group.WORLD)
    if mode == "megatron":  # Megatron's constructor: RemoteCopyService(group=...)
        import torch.distributed as dist

        from reshard.megatron import RemoteCopyService

        dist.init_process_group("gloo")
        group = dist.new_group(list(range(dist.get_world_size())))
        return RemoteCopyService(transport="host", group=group)
    if mode == "mpi":
        from mpi4py import MPI

        return reshard.CopyService("host", MPI.COMM_WORLD)
    raise SystemExit(f"unknown mode {mode}")


def main():
    svc = service_for(sys.argv[1], sys.argv[2:]).init("WARN")
    me, n = svc.my_pe, svc.n_pes
    src = np.full(4096, me + 1, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    svc.register_send(me, src, 0, 4096, (me + 1) % n)
    svc.register_receive((me - 1) % n, dst, 0, 4096, (me - 1) % n)

    # PE 0 schedules while the last PE is still sleeping: a Python thread must keep running.
    ticks = [0]
    done = threading.Event()

    def tick():
        while not done.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    ticker = threading.Thread(target=tick)
    ticker.start()
    if me == n - 1:
        time.sleep(1.0)
    start = time.monotonic()
    svc.schedule()
    waited = time.monotonic() - start
    done.set()
    ticker.join()
    svc.run()
    if not (dst == ((me - 1) % n) + 1).all():
        print(f"PE {me}: wrong bytes", file=sys.stderr)
        return 1
    if me == 0 and waited > 0.5 and ticks[0] < 100:
        print(f"PE 0: only {ticks[0]} ticks in {waited:.2f} s: schedule() held the GIL",
              file=sys.stderr)
        return 1
    svc.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
