"""One PE of a 2-PE GPU job whose copies to the peer are equal in size and increase in address on
both sides, so the transport merges them into one descriptor of "rows": (a) two pieces 2.5 GiB
apart in one allocation, (b) two pieces of separate allocations (as a model's tensors are). A
2-D copy may neither use a pitch past the device's limit nor span allocations; every engine must
move them. Prints "rank R: ok".

    far_apart_copies_worker.py
"""

import os

import torch

import reshard


def pieces(generator, count, size):
    return torch.randint(0, 256, (count, size), dtype=torch.uint8, device="cuda",
                         generator=generator)


def check(engine, case, me, n):
    svc = reshard.CopyService("cuda", cuda={"engine": engine}).init("WARN")
    peer, source = (me + 1) % n, (me - 1) % n
    if case == "one allocation":
        size, span = 8192, 5 << 29
        memory = torch.zeros(span + size, dtype=torch.uint8, device="cuda")
        landing = torch.zeros_like(memory)
        sends = [(memory, 0), (memory, span)]
        receives = [(landing, 0), (landing, span)]
    else:  # two allocations each side, large enough for allocations of their own
        size = 4 << 20
        sends = sorted(((torch.zeros(64 << 20, dtype=torch.uint8, device="cuda"), 0)
                        for _ in range(2)), key=lambda t: t[0].data_ptr())
        receives = sorted(((torch.zeros(64 << 20, dtype=torch.uint8, device="cuda"), 0)
                           for _ in range(2)), key=lambda t: t[0].data_ptr())
    values = pieces(torch.Generator("cuda").manual_seed(me), 2, size)
    for i, (tensor, at) in enumerate(sends):
        tensor[at:at + size] = values[i]
        svc.register_send(10 * me + i, tensor, at, size, peer)
    for i, (tensor, at) in enumerate(receives):
        svc.register_receive(10 * source + i, tensor, at, size, source)
    svc.schedule()
    svc.run()
    torch.cuda.synchronize()
    want = pieces(torch.Generator("cuda").manual_seed(source), 2, size)
    for i, (tensor, at) in enumerate(receives):
        assert torch.equal(tensor[at:at + size], want[i]), \
            f"rank {me}, engine {engine}, {case}: piece {i} differs"
    svc.finalize()


def main():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    me, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for engine in ("ce", "sm", "auto"):
        for case in ("one allocation", "separate allocations"):
            check(engine, case, me, n)
    print(f"rank {me}: ok")


if __name__ == "__main__":
    main()
