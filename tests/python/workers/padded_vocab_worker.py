"""One rank of a refit between two layouts that pad a vocabulary differently (host transport,
NumPy): the trainer pads 1,000 rows to a multiple of 128 x TP as Megatron-LM does, the engine to a
multiple of 96 (vLLM pads to 64). Every real row must land in its place, bit for bit; the
sources' padding rows (filled with a marker) must never travel, and the destinations' padding
rows must keep what they held. Then a refit between vocabularies of different real sizes is
refused, naming the parameter and both sizes.

    padded_vocab_worker.py
"""

import sys

import numpy as np

import reshard
from reshard_worker import bf16, element_values

PADDING = 0x7F7F  # what the sources' padding rows hold: must never arrive
UNTOUCHED = 0xABCD  # what the destinations hold before the refit


def model(vocab):
    def param(name, shape, stage, **extra):
        return reshard.ModelParam(reshard.ParamSpec(name, shape), stage=stage, **extra)

    return reshard.ModelSpec("padded", 1, 0, [
        param("embed.weight", [vocab, 32], "first", tp_dim=0, vocab=True),
        param("layers.0.proj.weight", [64, 32], "layer", tp_dim=1),
        param("head.weight", [vocab, 32], "last", tp_dim=0, vocab=True)])


def main():
    svc = reshard.CopyService("host").init("WARN")
    me, n = svc.my_pe, svc.n_pes
    spec = model(1000)
    src_layout = reshard.build_layout(spec, reshard.Parallelism(tp=n, vocab_multiple=128 * n))
    dst_tp = 2 if n % 2 == 0 else 1
    dst_layout = reshard.build_layout(
        spec, reshard.Parallelism(tp=dst_tp, replicas=n // dst_tp, vocab_multiple=96))
    plan = reshard.make_reshard_plan(src_layout, dst_layout)
    failures = []
    real = {p.spec.name: p.spec.shape for p in spec.params}

    def real_rows(name, offset, extent):
        """How many of a block's rows (from its first) hold real values."""
        return max(0, min(extent[0], real[name][0] - offset[0]))

    src, dst = {}, {}
    for index, param in enumerate(spec.params):
        name = param.spec.name
        shape = src_layout.local_shape(me, name)
        if shape is not None:
            tensor = np.full(shape, PADDING, dtype=np.uint16)
            for offset, extent, local_at in src_layout.pieces(me, name):
                rows = real_rows(name, offset, extent)
                if rows:
                    where = tuple(slice(a, a + e) for a, e in zip(local_at, [rows] + extent[1:]))
                    tensor[where] = element_values(index, offset, [rows] + extent[1:], real[name])
            src[name] = tensor
        shape = dst_layout.local_shape(me, name)
        if shape is not None:
            dst[name] = np.full(shape, UNTOUCHED, dtype=np.uint16)

    def check(label):
        for index, param in enumerate(spec.params):
            name = param.spec.name
            if name not in dst:
                continue
            for offset, extent, local_at in dst_layout.pieces(me, name):
                rows = real_rows(name, offset, extent)
                block = dst[name][tuple(slice(a, a + e) for a, e in zip(local_at, extent))]
                want = element_values(index, offset, [rows] + extent[1:], real[name])
                if not np.array_equal(block[:rows], want):
                    failures.append(f"{label}: real rows of '{name}' differ at {offset}")
                if not np.all(block[rows:] == UNTOUCHED):
                    failures.append(f"{label}: padding rows of '{name}' were written at "
                                    f"{offset[0] + rows}..{offset[0] + extent[0]}")

    reshard.execute_reshard_plan(plan, bf16(src), bf16(dst), svc)
    check("execute_reshard_plan")
    for tensor in dst.values():
        tensor[...] = UNTOUCHED
    refit = reshard.bind(plan, bf16(src), bf16(dst), svc)
    refit.run()
    check("bound run()")
    refit.close()
    if src_layout.params[0].shape[0] == dst_layout.params[0].shape[0]:
        failures.append("both sides padded alike: the test shows nothing")

    try:  # 1,000 real rows on one side, 1,001 on the other
        reshard.make_reshard_plan(src_layout, reshard.build_layout(
            model(1001), reshard.Parallelism(tp=dst_tp, replicas=n // dst_tp)))
        failures.append("vocabularies of 1,000 and 1,001 rows were planned")
    except reshard.ReshardError as error:
        if "'embed.weight' differs" not in str(error) or "0:1001" not in str(error):
            failures.append(f"refusal says: {error}")

    for failure in failures[:10]:
        print(f"rank {me}: {failure}", file=sys.stderr)
    if not failures:
        print(f"rank {me}: ok (source {src_layout.params[0]}, destination "
              f"{dst_layout.params[0]})")
    svc.finalize()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
