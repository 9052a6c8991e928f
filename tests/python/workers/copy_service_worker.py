"""One PE of a copy-service test job (started by reshard.launch): a random workload that every PE
derives from the same seed, run twice and checked byte for byte, then a request without a partner
that schedule() must refuse on every PE.

    worker.py SEED [numpy|torch-cuda|cupy-cuda|jax-cuda] [TRANSPORT]

TRANSPORT: the transport to name in code (default: host for numpy, else cuda).

JAX arrays are immutable to JAX, so the jax-cuda destination is zero only before the first run.
"""

import sys

import numpy as np

import reshard


def main() -> int:
    seed, memory = int(sys.argv[1]), (sys.argv[2] if len(sys.argv) > 2 else "numpy")
    transport = sys.argv[3] if len(sys.argv) > 3 else "host" if memory == "numpy" else "cuda"
    svc = reshard.CopyService(transport=transport).init("WARN")
    me, n = svc.my_pe, svc.n_pes
    if svc.transport != transport:
        print(f"PE {me}: asked for {transport} but the service runs {svc.transport}",
              file=sys.stderr)
        return 1
    rng = np.random.default_rng(seed)
    # Every PE draws the whole job's requests, so sender and receiver agree on them.
    requests = []
    for task in range(int(rng.integers(1, 40))):
        src, dst = int(rng.integers(n)), int(rng.integers(n))
        size = int(rng.choice([1, 3, 64, 4099, 1 << 16, 1 << 20]))
        requests.append((task * 7 + 1, src, dst, size, int(rng.integers(0, 17)),
                         int(rng.integers(0, 17))))
    send_bytes = sum(r[4] + r[3] for r in requests if r[1] == me) + 1
    recv_bytes = sum(r[5] + r[3] for r in requests if r[2] == me) + 1
    source = (np.arange(send_bytes, dtype=np.int64) * 31 + me * 7 + seed).astype(np.uint8)
    target = np.zeros(recv_bytes, dtype=np.uint8)
    expected = np.zeros_like(target)
    if memory == "torch-cuda":
        import torch

        torch.cuda.set_device(svc.device)
        device_source = torch.from_numpy(source).cuda()
        device_target = torch.zeros(recv_bytes, dtype=torch.uint8, device="cuda")
    elif memory == "cupy-cuda":
        import cupy

        cupy.cuda.Device(svc.device).use()
        device_source = cupy.asarray(source)
        device_target = cupy.zeros(recv_bytes, dtype=cupy.uint8)
    elif memory == "jax-cuda":
        import jax

        gpu = jax.devices("gpu")[svc.device]
        device_source = jax.device_put(source, gpu).block_until_ready()
        device_target = jax.device_put(target, gpu).block_until_ready()
    send_at = recv_at = 0
    senders_data = {}
    for task, src, dst, size, send_pad, recv_pad in requests:
        if src == me:
            send_at += send_pad
            svc.register_send(task, device_source if memory != "numpy" else source, send_at, size,
                              dst)
            send_at += size
        if dst == me:
            recv_at += recv_pad
            svc.register_receive(task, device_target if memory != "numpy" else target, recv_at,
                                 size, src)
            senders_data[task] = (recv_at, src)
            recv_at += size
    # What each sender's bytes are, recomputed here from the same formula and offsets.
    offsets = {}
    for pe in range(n):
        at = 0
        for task, src, dst, size, send_pad, recv_pad in requests:
            if src == pe:
                at += send_pad
                offsets[task] = at
                at += size
    for task, src, dst, size, _, _ in requests:
        if dst == me:
            start = offsets[task]
            values = ((np.arange(start, start + size, dtype=np.int64) * 31 + src * 7 + seed)
                      .astype(np.uint8))
            expected[senders_data[task][0]:senders_data[task][0] + size] = values
    svc.schedule()
    for _ in range(2):
        if memory == "numpy":
            target[:] = 0
            svc.run()
            got = target
        elif memory == "torch-cuda":
            device_target.zero_()
            svc.run(torch.cuda.current_stream())
            svc.synchronize()
            got = device_target.cpu().numpy()
        elif memory == "cupy-cuda":
            device_target.fill(0)
            svc.run(cupy.cuda.get_current_stream())
            svc.synchronize()
            got = cupy.asnumpy(device_target)
        else:
            svc.run()
            got = np.asarray(device_target)
        if not np.array_equal(got, expected):
            print(f"PE {me}: {np.count_nonzero(got != expected)} wrong bytes", file=sys.stderr)
            return 1

    # A send nobody receives: every PE must refuse it at schedule(), naming the task.
    svc.clear_requests()
    lonely = 999_999
    if me == 0:
        svc.register_send(lonely, device_source if memory != "numpy" else source, 0, 1, n - 1)
    try:
        svc.schedule()
    except reshard.ReshardError as error:
        if error.code != "validation" or lonely not in error.tasks:
            print(f"PE {me}: wrong error {error.code} {error.tasks}: {error}", file=sys.stderr)
            return 1
    else:
        print(f"PE {me}: schedule() accepted a send without a receive", file=sys.stderr)
        return 1
    svc.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
