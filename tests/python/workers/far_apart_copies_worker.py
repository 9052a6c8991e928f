"""One PE of a 2-PE GPU job whose copies to the peer are equal in size and increase in address on
both sides but lie GiBs apart (two small tensors at either end of a large allocation, as a
model's norms sit between its matrices): the copy engine must still move them (a pitch past the
device's limit once made cudaMemcpy2DAsync refuse them). Every engine; prints "rank R: ok".

    far_apart_copies_worker.py
"""

import os

import torch

import reshard

SPAN = 5 << 29  # 2.5 GiB between the two copies
PIECE = 8192


def main():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    for engine in ("ce", "sm", "auto"):
        svc = reshard.CopyService("cuda", cuda={"engine": engine}).init("WARN")
        me, n = svc.my_pe, svc.n_pes
        peer = (me + 1) % n
        memory = torch.zeros(SPAN + PIECE, dtype=torch.uint8, device="cuda")
        sent = torch.randint(0, 256, (2, PIECE), dtype=torch.uint8, device="cuda",
                             generator=torch.Generator("cuda").manual_seed(me))
        memory[:PIECE] = sent[0]
        memory[SPAN:] = sent[1]
        landing = torch.zeros(SPAN + PIECE, dtype=torch.uint8, device="cuda")
        for i, at in enumerate((0, SPAN)):
            svc.register_send(10 * me + i, memory, at, PIECE, peer)
            svc.register_receive(10 * ((me - 1) % n) + i, landing, at, PIECE, (me - 1) % n)
        svc.schedule()
        svc.run()
        torch.cuda.synchronize()
        expected = torch.randint(0, 256, (2, PIECE), dtype=torch.uint8, device="cuda",
                                 generator=torch.Generator("cuda").manual_seed((me - 1) % n))
        assert torch.equal(landing[:PIECE], expected[0]) and torch.equal(landing[SPAN:], expected[1]), \
            f"rank {me}, engine {engine}: the far-apart copies differ"
        svc.finalize()
        del memory, landing
    print(f"rank {me}: ok")


if __name__ == "__main__":
    main()
