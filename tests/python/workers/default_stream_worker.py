"""One rank of a job that writes its send buffers on PyTorch's default stream and hands reshard no
stream (or that default stream itself, whose handle is 0): the run must wait for those writes.
A long kernel (torch.cuda._sleep) holds the default stream before each write, so a run that did
not wait would read the buffers' old values. Through the copy service (run() and
run(torch.cuda.current_stream())) and through execute_reshard_plan without a stream.

    default_stream_worker.py
"""

import os
import sys

import torch

import reshard

SLEEP_CYCLES = 200_000_000  # about 0.1 s of GPU time: far longer than a run takes to start


def main():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    svc = reshard.CopyService("cuda")
    svc.init("WARN")
    me, n = svc.my_pe, svc.n_pes
    failures = []

    # The copy service: every PE sends 1 MiB to the next and receives from the previous.
    size = 1 << 20
    src = torch.zeros(size, dtype=torch.uint8, device="cuda")
    dst = torch.zeros(size, dtype=torch.uint8, device="cuda")
    svc.register_send(1000 + me, src, 0, size, (me + 1) % n)
    svc.register_receive(1000 + (me - 1) % n, dst, 0, size, (me - 1) % n)
    svc.schedule()
    for trial, stream in enumerate((None, torch.cuda.current_stream(), None)):
        value = 1 + 3 * trial + me
        ready = torch.full((size,), value, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)  # the default stream is busy ...
        src.copy_(ready)                  # ... and the send buffer is written after it
        svc.run(stream)
        if stream is not None:
            torch.cuda.current_stream().synchronize()
        want = 1 + 3 * trial + (me - 1) % n
        wrong = int((dst != want).sum())
        if wrong:
            failures.append(f"copy service, run({'stream' if stream else ''}) {trial}: {wrong} "
                            f"of {size} bytes are not the peer's {want} (first: {int(dst[0])})")
    svc.clear_requests()

    # execute_reshard_plan without a stream: TP n -> replicas of the whole.
    model = reshard.toy_model(2, 256)
    plan = reshard.make_reshard_plan(
        reshard.build_layout(model, reshard.Parallelism(tp=n)),
        reshard.build_layout(model, reshard.Parallelism(tp=1, replicas=n)))
    generator = torch.Generator().manual_seed(7)
    full = {p.name: torch.randn(tuple(p.shape), generator=generator).to(torch.bfloat16)
            for p in plan.params}
    sources, ready, destinations = {}, {}, {}
    for name, tensor in full.items():
        shape = plan.src_layout.local_shape(me, name)
        if shape is not None:
            local = torch.zeros(tuple(shape), dtype=torch.bfloat16)
            for offset, extent, local_at in plan.src_layout.pieces(me, name):
                at = tuple(slice(a, a + e) for a, e in zip(local_at, extent))
                local[at] = tensor[tuple(slice(o, o + e) for o, e in zip(offset, extent))]
            ready[name] = local.cuda()
            sources[name] = torch.zeros_like(ready[name])
        shape = plan.dst_layout.local_shape(me, name)
        if shape is not None:
            destinations[name] = torch.zeros(tuple(shape), dtype=torch.bfloat16, device="cuda")
    for refit in range(2):
        for tensor in destinations.values():
            tensor.zero_()
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        for name, tensor in sources.items():
            tensor.copy_(ready[name])
        reshard.execute_reshard_plan(plan, sources, destinations, svc)
        for name, tensor in destinations.items():
            if not torch.equal(tensor.cpu(), full[name]):
                failures.append(f"execute_reshard_plan, refit {refit}: '{name}' differs from the "
                                "source written on the default stream")
    svc.finalize()
    for failure in failures[:10]:
        print(f"rank {me}: {failure}", file=sys.stderr)
    if not failures:
        print(f"rank {me}: every run waited for the default stream")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
