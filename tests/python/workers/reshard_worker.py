"""One rank of a reshard test job (started by reshard.launch): every layout change of a small
model that fits the job, through execute_reshard_plan with NumPy tensors on the host transport,
each element checked against the full weight; then the two MXFP8 modes must agree bit for bit
(both are checked against the C++ reference in the C++ suite), Megatron's MXFP8 preset must give
Megatron's bits and swizzled scales (against a NumPy reference written from the format), and a
missing tensor is refused.
"""

import collections
import sys

import ml_dtypes
import numpy as np

import reshard



def element_values(param_index, offset, extent, shape):
    grids = np.meshgrid(*[np.arange(o, o + e, dtype=np.int64) for o, e in zip(offset, extent)],
                        indexing="ij")
    linear = np.zeros(tuple(extent), dtype=np.int64)
    for grid, size in zip(grids, shape):
        linear = linear * size + grid
    # Finite bf16 values of moderate size (exponent bits 0x3c..0x43), distinct per position.
    mantissa = (linear * 2654435761 + param_index * 40503) % 128
    exponent = 120 + (linear % 16)
    sign = (linear % 3 == 0).astype(np.int64) << 15
    return (sign | (exponent << 7) | mantissa).astype(np.uint16)


def tensors_for(layout, rank, plan, fill):
    out = {}
    for index, param in enumerate(plan.params):
        shape = layout.local_shape(rank, param.name)
        if shape is None:
            continue
        tensor = np.zeros(shape, dtype=np.uint16)
        if fill:
            for offset, extent, local_at in layout.pieces(rank, param.name):
                where = tuple(slice(a, a + e) for a, e in zip(local_at, extent))
                tensor[where] = element_values(index, offset, extent, param.shape)
        out[param.name] = tensor
    return out


def bf16(tensors):
    return {k: reshard.LocalTensor(v, dtype="bfloat16") for k, v in tensors.items()}


class ByteSplitTransform(reshard.ReshardTransform):
    """A transform written in Python: each bf16 element travels as its two bytes in two wire
    buffers, the high bytes flipped, so a slice that skipped the hooks would arrive wrong."""

    name = "byte-split"

    def __init__(self):
        self.wire = {}

    def should_transform(self, param):
        return len(param.shape) >= 2

    @staticmethod
    def _block(op):
        return tuple(slice(o, o + e) for o, e in zip(op.local_offset, op.extent))

    def _buffers(self, side, slice):
        key = (side, slice.task_id)
        if key not in self.wire:
            count = int(np.prod(slice.extent))
            self.wire[key] = [np.zeros(count, np.uint8), np.zeros(count, np.uint8)]
        return self.wire[key]

    def prepare_send(self, name, slice, tensor, stream):
        values = tensor.data[self._block(slice)].reshape(-1)
        high, low = self._buffers("send", slice)
        high[:] = (values >> 8).astype(np.uint8) ^ 0xFF
        low[:] = (values & 0xFF).astype(np.uint8)
        return [high, low]

    def prepare_recv(self, name, slice, tensor):
        return self._buffers("recv", slice)

    def finalize_recv(self, name, slice, tensor, buffers, stream):
        high, low = buffers
        values = ((high ^ 0xFF).astype(np.uint16) << 8) | low
        tensor.data[self._block(slice)] = values.reshape(slice.extent)


def fp8_destinations(transform, plan, layout, rank, scale_fill):
    """This rank's destination tensors for an FP8 transform: FP8 data (filled with 0xAB, so
    unwritten bytes show) and scales (filled with `scale_fill`) where the transform applies,
    zeroed bf16 elsewhere."""
    out = {}
    for name, tensor in tensors_for(layout, rank, plan, False).items():
        param = next(p for p in plan.params if p.name == name)
        if transform.should_transform(param):
            scale = transform.destination_scale(tensor.shape)
            out[name] = reshard.LocalTensor(np.full(tensor.shape, 0xAB, dtype=np.uint8),
                                            scale=np.full(scale.shape, scale_fill, np.uint8),
                                            dtype="float8_e4m3")
        else:
            out[name] = reshard.LocalTensor(tensor, dtype="bfloat16")
    return out


def megatron_mxfp8(values):
    """Megatron-LM's MXFP8 of a [M, K] bf16 tensor (uint16 bits), from the format's definition
    (what its quantizer computes): per 32 elements of a row, amax / 448 in float32 rounded up to a
    power of two is the scale; elements times its inverse, to E4M3 by rounding to nearest even.
    Returns the data bytes and the [M, K / 32] scale bytes (the E8M0 exponent fields)."""
    rows, cols = values.shape
    x = (values.astype(np.uint32) << 16).view(np.float32).reshape(rows, cols // 32, 32)
    amax = np.abs(x).max(axis=2)
    dequant = ((amax / np.float32(448)).view(np.uint32) + 0x7FFFFF) & 0x7F800000
    scale = dequant.view(np.float32)
    inverse = np.where(scale == 0, np.float32(0), np.float32(1) / np.where(scale == 0, 1, scale))
    data = (x * inverse[:, :, None].astype(np.float32)).astype(ml_dtypes.float8_e4m3fn)
    return data.view(np.uint8).reshape(rows, cols), (dequant >> 23).astype(np.uint8)


def swizzled(scales):
    """cuBLAS's blocked layout of a [M, C] scale matrix: 128 x 4 tiles of 512 bytes, tiles
    row-major, in a tile row r at (r % 32) * 16 + (r % 128) // 32 * 4 (+ column % 4); padded."""
    rows, cols = scales.shape
    col_tiles = -(-cols // 4)
    out = np.zeros(-(-rows // 128) * col_tiles * 512, dtype=np.uint8)
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    at = ((r // 128) * col_tiles + c // 4) * 512 + (r % 32) * 16 + (r % 128) // 32 * 4 + c % 4
    out[at] = scales
    return out


def check_megatron_mxfp8(plan, src, want, dst_layout, me, svc):
    """Both MXFP8 sides with Megatron's preset (its rounding, swizzled scales) against
    megatron_mxfp8 of the expected weights; returns the number of failures."""
    failures = 0
    for side in ("sender", "receiver"):
        transform = reshard.make_mxfp8_transform(side=side, rounding="megatron",
                                                 scale_layout="swizzled")
        # Zeroed scales: the padding of the swizzled layout must stay as it was.
        fp8 = fp8_destinations(transform, plan, dst_layout, me, scale_fill=0)
        for refit in range(2):
            reshard.execute_reshard_plan(plan, bf16(src), fp8, svc, transform)
            for name, got in fp8.items():
                if got.scale is None:
                    ok = np.array_equal(got.data, want[name])
                else:
                    data, scales = megatron_mxfp8(want[name])
                    ok = (np.array_equal(got.data, data) and
                          np.array_equal(got.scale, swizzled(scales)))
                if not ok:
                    print(f"rank {me}: Megatron MXFP8 by the {side}, refit {refit}: '{name}' "
                          "differs from Megatron's bits", file=sys.stderr)
                    failures += 1
                got.data[...] = 0
                if got.scale is not None:
                    got.scale[...] = 0
        svc.clear_requests()
    return failures


def cases(n):
    P = reshard.Parallelism
    p2 = n & -n
    half = max(1, p2 // 2)
    out = [(P(tp=p2, dp=n // p2), P(tp=half, replicas=n // half)), (P(dp=n), P(tp=p2, replicas=n // p2))]
    if p2 >= 2:
        out.append((P(tp=half, dp=n // p2, pp=2), P(tp=p2, replicas=n // p2)))
    if n % 4 == 0:
        out.append((P(tp=2, dp=n // 2, ep=2), P(tp=4, replicas=n // 4, ep=4)))
    return out


def main():
    svc = reshard.CopyService(transport="host").init("WARN")
    me, n = svc.my_pe, svc.n_pes
    failures = 0
    for src_par, dst_par in cases(n):
        moe = src_par.ep > 1 or dst_par.ep > 1
        model = reshard.toy_model(2, 256, 4 if moe else 0)
        src_layout = reshard.build_layout(model, src_par)
        dst_layout = reshard.build_layout(model, dst_par)
        plan = reshard.make_reshard_plan(src_layout, dst_layout)
        src = tensors_for(src_layout, me, plan, True)
        want = tensors_for(dst_layout, me, plan, True)
        dst = tensors_for(dst_layout, me, plan, False)
        # The third refit reruns the second: its tensors, not passed again.
        for refit in range(3):
            if refit < 2:
                report = reshard.execute_reshard_plan(plan, bf16(src), bf16(dst), svc)
            else:
                report = reshard.rerun_reshard_plan(plan, svc)
            assert report.rescheduled == (refit == 0), (refit, report.rescheduled)
            for name in want:
                if not np.array_equal(dst[name], want[name]):
                    print(f"rank {me}: {src_par} -> {dst_par}: '{name}' differs", file=sys.stderr)
                    failures += 1
                dst[name][...] = 0

        # The same through a transform written in Python.
        split = ByteSplitTransform()
        for refit in range(3):
            if refit < 2:
                report = reshard.execute_reshard_plan(plan, bf16(src), bf16(dst), svc, split)
            else:  # its hooks run again on the tensors they were bound to
                report = reshard.rerun_reshard_plan(plan, svc, split)
            assert report.rescheduled == (refit == 0), (refit, report.rescheduled)
            for name in want:
                if not np.array_equal(dst[name], want[name]):
                    print(f"rank {me}: Python transform: '{name}' differs", file=sys.stderr)
                    failures += 1
                dst[name][...] = 0

        # MXFP8 sender side (FP8 on the wire) and receiver side (bf16 on the wire) must agree.
        # The third within a staging budget that holds one op but not the refit: in phases.
        budget = 2 * max(op.bytes for op in plan.ops) + 4096
        results = []
        for side, staging_budget in (("sender", None), ("receiver", None), ("sender", budget)):
            transform = reshard.make_mxfp8_transform(side=side)
            fp8 = fp8_destinations(transform, plan, dst_layout, me, scale_fill=0xCD)
            report = reshard.execute_reshard_plan(plan, bf16(src), fp8, svc, transform,
                                                  staging_budget=staging_budget)
            if staging_budget is not None and report.staging_bytes > staging_budget:
                print(f"rank {me}: {report.staging_bytes} bytes of staging held, over the budget "
                      f"of {staging_budget}", file=sys.stderr)
                failures += 1
            # This rank's own slices are quantized in place (no wire), except, quantized by the
            # sender, a slice this rank also sends to others (replicas): converted once for all.
            def source_slice(op):
                return op.param, tuple(op.src_offset), tuple(op.extent)
            sends = collections.Counter(source_slice(op) for op in plan.ops if op.src_pe == me)
            expected = sum(op.bytes for op in plan.ops
                           if op.src_pe == me and op.dst_pe == me and
                           transform.should_transform(plan.params[op.param]) and
                           (side == "receiver" or sends[source_slice(op)] == 1))
            if report.locally_converted_bytes != expected:
                print(f"rank {me}: MXFP8 {side} converted {report.locally_converted_bytes} bytes "
                      f"in place, expected {expected}", file=sys.stderr)
                failures += 1
            results.append({k: (v.data.copy(), None if v.scale is None else v.scale.copy())
                            for k, v in fp8.items()})
            untouched = [k for k, v in fp8.items() if v.scale is not None and
                         (np.all(v.data == 0xAB) or np.all(v.scale == 0xCD))]
            if untouched:
                print(f"rank {me}: MXFP8 {side} left {untouched[:3]} unwritten", file=sys.stderr)
                failures += 1
        for name in results[0]:
            for other in results[1:]:
                for a, b in zip(results[0][name], other[name]):
                    if a is not None and not np.array_equal(a, b):
                        print(f"rank {me}: MXFP8 sender, receiver and sender in phases differ "
                              f"on '{name}'", file=sys.stderr)
                        failures += 1
        svc.clear_requests()
        if not moe:  # swizzled scales are laid out for 2-D weights
            failures += check_megatron_mxfp8(plan, src, want, dst_layout, me, svc)

    # A destination tensor missing on one rank is refused there, naming it, before any byte moves.
    model = reshard.toy_model(1, 128)
    plan = reshard.make_reshard_plan(reshard.build_layout(model, reshard.Parallelism(dp=n)),
                                     reshard.build_layout(model, reshard.Parallelism(tp=1, replicas=n)))
    layout = plan.dst_layout
    dst = tensors_for(layout, me, plan, False)
    missing = sorted(dst)[0]
    del dst[missing]
    try:
        reshard.execute_reshard_plan(plan, bf16(tensors_for(plan.src_layout, me, plan, True)),
                                     bf16(dst), svc)
    except reshard.ReshardError as error:
        if missing not in str(error) or error.code != "invalid argument":
            print(f"rank {me}: unexpected error: {error}", file=sys.stderr)
            failures += 1
    else:
        print(f"rank {me}: a missing destination tensor was not refused", file=sys.stderr)
        failures += 1
    svc.finalize()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
