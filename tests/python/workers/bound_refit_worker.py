"""One rank of a job that binds a refit (TP n -> n replicas, every rank needs the others'
slices) and checks it element by element: runs with new values, an update() of one tensor on one
rank, a refusal found on one rank only (execute_reshard_plan, bind and update), each the same
error on every rank and followed by a corrected call that works. Prints "rank R: ok" at the end.

    bound_refit_worker.py
"""

import numpy as np

import reshard


def main():
    svc = reshard.CopyService("host").init("WARN")
    me, n = svc.my_pe, svc.n_pes
    culprit = n - 1
    model = reshard.toy_model(1, 64)
    plan = reshard.make_reshard_plan(reshard.build_layout(model, reshard.Parallelism(tp=n)),
                                     reshard.build_layout(model, reshard.Parallelism(dp=n)))
    src_layout, dst_layout = plan.src_layout, plan.dst_layout

    def tensors(layout, fill=None):
        out = {}
        for p in plan.params:
            shape = layout.local_shape(me, p.name)
            if shape is not None:
                data = np.zeros(shape, np.uint16) if fill is None else fill(p, shape)
                out[p.name] = reshard.LocalTensor(data, dtype="bfloat16")
        return out

    def whole(p, step):
        return (np.arange(np.prod(p.shape), dtype=np.uint32) * 7 + step * 1000 + len(p.name)
                ).astype(np.uint16).reshape(p.shape)

    def values(step):
        # This rank's blocks of the whole parameter, numbered by step, where the layout puts them.
        def fill(p, shape):
            local = np.zeros(shape, np.uint16)
            for offset, extent, local_at in src_layout.pieces(me, p.name):
                local[tuple(slice(o, o + e) for o, e in zip(local_at, extent))] = \
                    whole(p, step)[tuple(slice(o, o + e) for o, e in zip(offset, extent))]
            return local
        return fill

    def expected(step):
        return {p.name: whole(p, step) for p in plan.params}

    def check(dst, step, what):
        want = expected(step)
        for name, tensor in dst.items():
            assert np.array_equal(tensor.data, want[name]), f"rank {me}, {what}: '{name}' differs"

    src = tensors(src_layout, values(1))
    dst = tensors(dst_layout)
    refit = reshard.bind(plan, src, dst, svc)
    assert refit.report.rescheduled
    refit.run()
    check(dst, 1, "the first run")
    for name, tensor in src.items():  # the trainer's next weights, in place
        tensor.data[...] = tensors(src_layout, values(2))[name].data
    report = refit.run()
    assert not report.rescheduled and report.timing.check_seconds == report.timing.agree_seconds == 0
    check(dst, 2, "a run with new values")

    # One destination in new memory on the last rank only: every rank schedules again.
    name = sorted(dst)[0]
    fresh = {}
    if me == culprit:
        fresh[name] = dst[name] = reshard.LocalTensor(np.zeros_like(dst[name].data),
                                                           dtype="bfloat16")
    assert refit.update(dst=fresh).rescheduled
    refit.run()
    check(dst, 2, "after update()")
    assert not refit.update(src=src).rescheduled  # the same tensors: nothing scheduled

    # A tensor missing on one rank: the same error on every rank, naming it; then the retry.
    missing = sorted(src)[-1]
    partial = {k: v for k, v in src.items() if me != culprit or k != missing}
    for call in ("execute", "bind"):
        try:
            if call == "execute":
                reshard.execute_reshard_plan(plan, partial, dst, svc)
            else:
                reshard.bind(plan, partial, dst, svc)
            raise AssertionError(f"rank {me}: {call} ran without rank {culprit}'s tensor")
        except reshard.ReshardError as error:
            text = str(error)
            assert error.code == "invalid argument", (call, error.code, text)
            assert f"PE {culprit} refused the refit" in text, (call, text)
            assert f"no source tensor for '{missing}'" in text, (call, text)
        for tensor in dst.values():
            tensor.data[...] = 0
        if call == "execute":
            reshard.execute_reshard_plan(plan, src, dst, svc)
        else:
            refit = reshard.bind(plan, src, dst, svc)
            refit.run()
        check(dst, 2, f"the corrected {call}")

    # A tensor the binding cannot read, on one rank: the same error on every rank.
    unreadable = dict(src)
    if me == culprit:
        unreadable[missing] = "not an array"
    for call in (lambda: reshard.bind(plan, unreadable, dst, svc),
                 lambda: refit.update(src=unreadable)):
        try:
            call()
            raise AssertionError(f"rank {me}: a string was taken for a tensor")
        except reshard.ReshardError as error:
            assert f"PE {culprit} refused the refit" in str(error), str(error)
            assert "is not an array reshard can read" in str(error), str(error)

    # update() with a name the refit does not hold, on one rank: refused everywhere, the refit
    # runs on as it was.
    bogus = {"bogus.weight": next(iter(src.values()))} if me == culprit else {}
    try:
        refit.update(src=bogus)
        raise AssertionError(f"rank {me}: update() took a name the refit does not hold")
    except reshard.ReshardError as error:
        assert "'bogus.weight' is not a source tensor" in str(error), str(error)
    for tensor in dst.values():
        tensor.data[...] = 0
    refit.run()
    check(dst, 2, "after a refused update()")
    svc.finalize()
    print(f"rank {me}: ok")


if __name__ == "__main__":
    main()
