"""One rank of a 2-rank job in which rank 1 comes late to the calls that open a refit, with a short
transfer timeout (1 s) and a longer arrival timeout (4 s):

1. Rank 1 comes to bind() 6 s late: both ranks' bind() fail alike (rank 0's within the arrival
   timeout), naming PE 1 and saying nothing took effect; both then bind again, which works, and
   run() moves every element.
2. Rank 1 comes to update() 2.5 s late (later than the transfer timeout, within the arrival
   timeout): the update and the next run work.
3. Rank 1 comes to a bound run() 6 s late: rank 0's run gives up within the arrival timeout,
   saying the service is usable; rank 0 runs the refit again, which meets rank 1's late run, and
   both move every element.
4. Rank 1 comes to execute_reshard_plan 2.5 s late: it works.

Prints "rank R: ok" when its part held.

    late_bind_worker.py
"""

import os
import sys
import time

import numpy as np

import reshard


def main():
    svc = reshard.CopyService("host", timeout=1, arrival_timeout=4).init("WARN")
    me, n = svc.my_pe, svc.n_pes
    model = reshard.toy_model(1, 64)
    plan = reshard.make_reshard_plan(reshard.build_layout(model, reshard.Parallelism(tp=n)),
                                     reshard.build_layout(model, reshard.Parallelism(dp=n)))

    def whole(p, step):
        return (np.arange(np.prod(p.shape), dtype=np.uint32) * 7 + step * 1000 + len(p.name)
                ).astype(np.uint16).reshape(p.shape)

    def tensors(layout, step=None):
        out = {}
        for p in plan.params:
            shape = layout.local_shape(me, p.name)
            if shape is None:
                continue
            local = np.zeros(shape, np.uint16)
            if step is not None:
                for offset, extent, at in layout.pieces(me, p.name):
                    local[tuple(slice(o, o + e) for o, e in zip(at, extent))] = \
                        whole(p, step)[tuple(slice(o, o + e) for o, e in zip(offset, extent))]
            out[p.name] = reshard.LocalTensor(local, dtype="bfloat16")
        return out

    def check(dst, step, what):
        for p in plan.params:
            if p.name in dst:
                assert np.array_equal(dst[p.name].data, whole(p, step)), \
                    f"rank {me}, {what}: '{p.name}' differs"

    src, dst = tensors(plan.src_layout, 1), tensors(plan.dst_layout)

    if me == 1:
        time.sleep(6)  # rank 0 gave up at 4 s and waits again in its second bind()
    started = time.monotonic()
    try:
        reshard.bind(plan, src, dst, svc)
        raise AssertionError("bind() finished without PE 1")
    except reshard.ReshardError as error:
        waited, text = time.monotonic() - started, str(error)
        assert error.code == "timeout", (error.code, text)
        assert error.retryable, text
        for words in ("every PE must call bind()", "arrival timeout",
                      "PE 1 did not call bind() in time", "nothing took effect",
                      "call bind() again on every PE"):
            assert words in text, (words, text)
        if me == 0:
            assert 3.5 < waited < 7.5, f"waited {waited:.1f} s for a 4 s arrival timeout"
    refit = reshard.bind(plan, src, dst, svc)
    refit.run()
    check(dst, 1, "the bind retried")

    fresh = tensors(plan.src_layout, 2)
    if me == 1:
        time.sleep(2.5)
    refit.update(src=fresh)  # later than the 1 s transfer timeout, within the 4 s arrival timeout
    refit.run()
    check(dst, 2, "after a late update()")

    for name, values in tensors(plan.src_layout, 3).items():
        fresh[name].data[...] = values.data
    if me == 1:
        time.sleep(6)
    if me == 0:
        try:
            refit.run()
            raise AssertionError("a bound run finished without rank 1")
        except reshard.ReshardError as error:
            text = str(error)
            assert error.code == "timeout" and error.retryable, (error.code, text)
            assert "for PE 1 to begin run()" in text and "run again on every PE" in text, text
    refit.run()  # rank 0: again; rank 1: late, it meets rank 0's second run
    check(dst, 3, "a bound run given up and run again")
    refit.close()

    dst = tensors(plan.dst_layout)
    if me == 1:
        time.sleep(2.5)
    reshard.execute_reshard_plan(plan, tensors(plan.src_layout, 4), dst, svc)
    check(dst, 4, "a late execute_reshard_plan")
    print(f"rank {me}: ok")
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
