"""Refit a Megatron-style TP=4 layout into a vLLM-style TP=2 layout (2 replicas) and check it.

    python -m reshard.launch -n 4 examples/python/refit_tp4_to_tp2.py [--device cpu|cuda]

Every rank holds its TP=4 training shard of each weight of a small Llama-shaped model and receives
its TP=2 inference shard; every element is compared with the value the full weight holds there.
Works with NumPy on the host transport, or with PyTorch CUDA tensors (one GPU per process).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import reshard


def element_values(param_index: int, offset, extent, shape) -> np.ndarray:
    """The bf16 bit patterns of a block of the full weight: a function of the global position,
    so any misplaced element is caught."""
    grids = np.meshgrid(*[np.arange(o, o + e, dtype=np.int64) for o, e in zip(offset, extent)],
                        indexing="ij")
    linear = np.zeros(tuple(extent), dtype=np.int64)
    for grid, size in zip(grids, shape):
        linear = linear * size + grid
    return ((linear * 2654435761 + param_index * 40503) % 65521).astype(np.uint16)


def local_tensor(layout, rank: int, index: int, param, fill: bool) -> np.ndarray:
    shape = layout.local_shape(rank, param.name)
    tensor = np.zeros(shape, dtype=np.uint16)
    if fill:
        for offset, extent, local_at in layout.pieces(rank, param.name):
            where = tuple(slice(a, a + e) for a, e in zip(local_at, extent))
            tensor[where] = element_values(index, offset, extent, param.shape)
    return tensor


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--refits", type=int, default=2)
    options = parser.parse_args()

    transport = "host" if options.device == "cpu" else "cuda"
    service = reshard.CopyService(transport=transport).init("WARN")
    me, n = service.my_pe, service.n_pes
    if n != 4:
        print("run with 4 processes: python -m reshard.launch -n 4 ...", file=sys.stderr)
        return 2

    model = reshard.toy_model(layers=2, hidden=256)
    trainer = reshard.build_layout(model, reshard.Parallelism(tp=4))
    engine = reshard.build_layout(model, reshard.Parallelism(tp=2, replicas=2))
    plan = reshard.make_reshard_plan(trainer, engine)

    src, dst, expected = {}, {}, {}
    for index, param in enumerate(plan.params):
        if trainer.local_shape(me, param.name) is not None:
            src[param.name] = local_tensor(trainer, me, index, param, fill=True)
        if engine.local_shape(me, param.name) is not None:
            expected[param.name] = local_tensor(engine, me, index, param, fill=True)
            dst[param.name] = np.zeros_like(expected[param.name])

    if options.device == "cuda":
        import torch

        torch.cuda.set_device(service.device)
        to_gpu = lambda a: torch.from_numpy(a.view(np.int16)).cuda()  # noqa: E731
        src = {k: to_gpu(v) for k, v in src.items()}
        dst = {k: to_gpu(v) for k, v in dst.items()}

    as_bf16 = lambda tensors: {k: reshard.LocalTensor(v, dtype="bfloat16")  # noqa: E731
                               for k, v in tensors.items()}
    # Bound once (collective: every tensor checked against the plan, the schedule made); each
    # refit then only moves the bytes. The trainer updates `src` in place between refits.
    bound = reshard.bind(plan, as_bf16(src), as_bf16(dst), service)
    for refit in range(options.refits):
        report = bound.run()
        wrong = 0
        for name, want in expected.items():
            got = dst[name]
            if options.device == "cuda":
                got = got.cpu().numpy().view(np.uint16)
            wrong += int(np.count_nonzero(got != want))
            got[...] = 0  # the next refit must write it again
            if options.device == "cuda":
                dst[name].zero_()
        if wrong:
            print(f"rank {me}: refit {refit}: {wrong} wrong elements", file=sys.stderr)
            return 1
        if me == 0:
            print(f"refit {refit}: {plan.summary()}; {report.bytes_sent} bytes sent by rank 0; "
                  "all elements match")
    bound.close()
    service.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
