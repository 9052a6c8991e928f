"""One rank of a job that stages and commits a refit (TP n -> n replicas of a toy model, every
rank needs the others' slices), checked element by element; prints "rank R: ok CASE".

    staged_refit_worker.py commit|budget|dead_peer|killed_in_stage [numpy|torch-cuda]

- commit: stage() leaves the destinations as they were and commit() writes what a plain refit
  writes (also MXFP8 data and scales), the version advancing only on commit; update(), run().
- budget: max_staged_bytes below a rank's need refuses the refit on every rank, saying how much.
- dead_peer: the last rank leaves before stage(); the others' stage() fails within the timeout,
  saying no destination tensor was written, and every destination holds its old values.
- killed_in_stage: the same with the last rank gone while it is inside stage(), after a few whole
  stages (a larger model, so that most of each rank's time is in the transfer): the others fail
  within the timeout naming it, their destinations unchanged, version 0.
"""

import os
import sys
import threading
import time

import numpy as np

import reshard


def arrays(kind):
    if kind == "torch-cuda":
        import torch

        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())

        def make(values, dtype=np.uint16):
            host = np.ascontiguousarray(values).astype(dtype)
            if dtype == np.uint16:
                return torch.from_numpy(host.view(np.int16)).view(torch.bfloat16).cuda()
            return torch.from_numpy(host).cuda()

        def read(tensor, dtype=np.uint16):
            host = tensor.cpu()
            if host.dtype == torch.bfloat16:
                host = host.view(torch.int16)
            return host.numpy().view(dtype)

        return make, read, "cuda"
    return (lambda values, dtype=np.uint16: np.ascontiguousarray(values).astype(dtype),
            lambda array, dtype=np.uint16: array.view(dtype), "host")


def main():
    case, kind = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "numpy"
    make, read, transport = arrays(kind)
    svc = reshard.CopyService(transport).init("WARN")
    me, n = svc.my_pe, svc.n_pes
    model = reshard.toy_model(2, 1024 if case == "killed_in_stage" else 128)
    plan = reshard.make_reshard_plan(reshard.build_layout(model, reshard.Parallelism(tp=n)),
                                     reshard.build_layout(model, reshard.Parallelism(dp=n)))

    def whole(p, step):
        count = int(np.prod(p.shape))
        bits = (np.arange(count, dtype=np.uint32) * 7 + step * 1000 + len(p.name)) % 16000 + 15000
        return bits.astype(np.uint16).reshape(p.shape)  # finite positive bf16 values

    def tensors(layout, step):
        out = {}
        for p in plan.params:
            shape = layout.local_shape(me, p.name)
            if shape is None:
                continue
            local = np.zeros(shape, np.uint16)
            for offset, extent, at in layout.pieces(me, p.name):
                local[tuple(slice(a, a + e) for a, e in zip(at, extent))] = \
                    whole(p, step)[tuple(slice(o, o + e) for o, e in zip(offset, extent))]
            out[p.name] = reshard.LocalTensor(make(local), dtype="bfloat16")
        return out

    def values(dst):
        return {name: read(t.data).copy() for name, t in dst.items()}

    def check(dst, step, what):
        want = tensors(plan.dst_layout, step)
        for name, tensor in dst.items():
            assert np.array_equal(read(tensor.data), read(want[name].data)), \
                f"rank {me}, {what}: '{name}' differs"

    src = tensors(plan.src_layout, 1)
    dst = tensors(plan.dst_layout, 0)  # the engine's old weights
    if case == "commit":
        refit = reshard.bind(plan, src, dst, svc, staged=True)
        assert refit.version == 0 and not refit.staged
        assert refit.staged_bytes == sum(int(np.prod(t.data.shape)) * 2 for t in dst.values())
        refit.stage()
        assert refit.staged and refit.version == 0
        check(dst, 0, "after stage(), before commit()")
        refit.commit()
        assert refit.version == 1 and not refit.staged
        check(dst, 1, "after commit()")
        try:
            refit.commit()
            raise AssertionError(f"rank {me}: a second commit() without a stage()")
        except reshard.ReshardError as error:
            assert "nothing is staged" in str(error) and "version 1" in str(error), str(error)
        # The trainer's next weights: run() is stage() and commit().
        for name, tensor in tensors(plan.src_layout, 2).items():
            src[name].data[...] = tensor.data
        refit.run()
        assert refit.version == 2
        check(dst, 2, "after run()")
        # A destination in new memory on the last rank: update(), stage and commit into it.
        name = sorted(dst)[0]
        fresh = {}
        if me == n - 1:
            fresh[name] = dst[name] = reshard.LocalTensor(make(np.zeros(dst[name].data.shape)),
                                                          dtype="bfloat16")
        refit.update(dst=fresh)
        refit.stage()
        refit.commit()
        check(dst, 2, "after update()")
        # MXFP8 on arrival, staged, against the same refit plain (data and scales bitwise).
        mx = reshard.make_mxfp8_transform(side="receiver")

        def fp8_destinations():
            out = {}
            for p in plan.params:
                shape = plan.dst_layout.local_shape(me, p.name)
                if shape is None:
                    continue
                if len(shape) < 2:  # norms stay bf16 (MXFP8 scales rows of matrices)
                    out[p.name] = reshard.LocalTensor(make(np.full(shape, 7)), dtype="bfloat16")
                    continue
                scale = mx.destination_scale(tuple(shape))
                out[p.name] = reshard.LocalTensor(
                    make(np.full(shape, 7), np.uint8), dtype="float8_e4m3",
                    scale=make(np.full(scale.shape, 3), np.uint8))
            return out

        staged_fp8, plain_fp8 = fp8_destinations(), fp8_destinations()
        other = reshard.CopyService(transport).init("WARN")
        fp8 = reshard.bind(plan, src, staged_fp8, svc, mx, staged=True)
        fp8.stage()
        for name, t in staged_fp8.items():
            assert (read(t.data, np.uint8 if t.scale is not None else np.uint16) == 7).all() and \
                (t.scale is None or (read(t.scale, np.uint8) == 3).all()), \
                f"rank {me}: MXFP8 '{name}' written before commit()"
        fp8.commit()
        reshard.bind(plan, src, plain_fp8, other, mx).run()
        for name in staged_fp8:
            for part in ("data", "scale") if staged_fp8[name].scale is not None else ("data",):
                a = read(getattr(staged_fp8[name], part), np.uint8)
                b = read(getattr(plain_fp8[name], part), np.uint8)
                assert np.array_equal(a, b), f"rank {me}: MXFP8 '{name}' {part} differs"
        other.finalize()
    elif case == "budget":
        need = sum(int(np.prod(t.data.shape)) * 2 for t in dst.values())
        limit = need - 1 if me == n - 1 else need * 2  # only the last rank is over
        try:
            reshard.bind(plan, src, dst, svc, staged=True, max_staged_bytes=limit)
            raise AssertionError(f"rank {me}: bound past max_staged_bytes")
        except reshard.ReshardError as error:
            text = str(error)
            assert f"PE {n - 1} refused" in text and "max_staged_bytes" in text, text
        refit = reshard.bind(plan, src, dst, svc, staged=True, max_staged_bytes=need)
        refit.run()
        check(dst, 1, "within the limit")
    elif case == "dead_peer":
        refit = reshard.bind(plan, src, dst, svc, staged=True)
        before = values(dst)
        if me == n - 1:
            sys.stdout.flush()
            os._exit(0)  # leaves without a word, as a crashed peer does
        try:
            refit.stage()
            raise AssertionError(f"rank {me}: stage() finished without rank {n - 1}")
        except reshard.ReshardError as error:
            assert "no destination tensor was written" in str(error), str(error)
        for name, array in values(dst).items():
            assert np.array_equal(array, before[name]), f"rank {me}: '{name}' was written"
        assert refit.version == 0 and not refit.staged
    elif case == "killed_in_stage":
        refit = reshard.bind(plan, src, dst, svc, staged=True)
        before = values(dst)
        timeout = float(os.environ["RESHARD_TIMEOUT_S"])
        if me == n - 1:
            inside = threading.Event()

            def vanish():  # as a crashed peer does: no word, mid-transfer
                time.sleep(0.3)
                inside.wait()
                os._exit(0)  # 0: the launcher leaves the others running, to see what they do

            threading.Thread(target=vanish, daemon=True).start()
        start = time.monotonic()
        stages = 0
        try:
            while time.monotonic() - start < 4 * timeout:
                if me == n - 1 and stages >= 3:
                    inside.set()  # stage() releases the interpreter while it moves the bytes
                refit.stage()
                stages += 1
            raise AssertionError(f"rank {me}: {stages} stages finished without rank {n - 1}")
        except reshard.ReshardError as error:
            text = str(error)
            assert "no destination tensor was written" in text and f"PE {n - 1}" in text, text
        failed_after = time.monotonic() - start
        assert failed_after < timeout + 10, f"rank {me}: failed after {failed_after:.1f} s"
        for name, array in values(dst).items():
            assert np.array_equal(array, before[name]), f"rank {me}: '{name}' was written"
        assert refit.version == 0
        print(f"rank {me}: {stages} stages, then failed after {failed_after:.1f} s")
    print(f"rank {me}: ok {case}")
    sys.stdout.flush()
    os._exit(0)  # without finalize(): a peer is gone


if __name__ == "__main__":
    main()
