"""One rank of a job checking reshard's Megatron MXFP8 preset (rounding "megatron", swizzled
scales) against Megatron-LM's own quantizer (its Triton kernel, megatron-core >= 0.17) on a GPU:
for two layout changes and both sides (MXFP8 made by the sender, or on arrival), every rank's
persistent FP8 data and swizzled E8M0 scales must equal, byte for byte, what Megatron's
mxfp8_quantize writes for that rank's whole bf16 weight. The weights span every magnitude a
model holds, with some blocks so small that Megatron's 2^-126 scale floor decides.
"""

import sys

import torch

import reshard
from megatron.core.inference.quantization.mxfp8_quantize import mxfp8_quantize


def full_weight(shape, seed):
    generator = torch.Generator().manual_seed(seed)
    rows, cols = shape
    values = torch.randn(rows, cols, generator=generator)
    # Magnitudes per block of 32 from 2^-140 to 2^60: tiny blocks meet the scale floor.
    exponents = torch.randint(-140, 60, (rows, cols // 32), generator=generator).float()
    values = values * torch.exp2(exponents).repeat_interleave(32, dim=1)
    values[0, :32] = 0  # an all-zero block
    return values.to(torch.bfloat16)


def local_of(layout, rank, name, full):
    shape = layout.local_shape(rank, name)
    if shape is None:
        return None
    out = torch.zeros(tuple(shape), dtype=torch.bfloat16)
    for offset, extent, local_at in layout.pieces(rank, name):
        out[tuple(slice(a, a + e) for a, e in zip(local_at, extent))] = \
            full[tuple(slice(o, o + e) for o, e in zip(offset, extent))]
    return out.cuda()


def main():
    svc = reshard.CopyService(transport="cuda").init("WARN")
    torch.cuda.set_device(svc.device)
    me, n = svc.my_pe, svc.n_pes
    P = reshard.Parallelism
    failures = 0
    for src_par, dst_par in ((P(tp=n), P(tp=1, replicas=n)), (P(dp=n), P(tp=n))):
        model = reshard.toy_model(2, 320)  # 10 scale columns: the last 4-column tile is padded
        src_layout = reshard.build_layout(model, src_par)
        dst_layout = reshard.build_layout(model, dst_par)
        plan = reshard.make_reshard_plan(src_layout, dst_layout)
        fulls = {p.name: full_weight(p.shape, i) for i, p in enumerate(plan.params)
                 if len(p.shape) == 2}
        for side in ("sender", "receiver"):
            transform = reshard.make_mxfp8_transform(side=side, rounding="megatron",
                                                     scale_layout="swizzled")
            src, dst, want = {}, {}, {}
            for p in plan.params:
                full = fulls.get(p.name)
                if full is None:  # 1-D weights: plain bf16
                    full = torch.zeros(tuple(p.shape), dtype=torch.bfloat16)
                if (t := local_of(src_layout, me, p.name, full)) is not None:
                    src[p.name] = t
                if (t := local_of(dst_layout, me, p.name, full)) is None:
                    continue
                if transform.should_transform(p):
                    scale = transform.destination_scale(list(t.shape))
                    dst[p.name] = reshard.LocalTensor(
                        torch.full(t.shape, 0xAB, dtype=torch.uint8, device="cuda"),
                        scale=torch.zeros(scale.shape, dtype=torch.uint8, device="cuda"),
                        dtype="float8_e4m3")
                    want[p.name] = mxfp8_quantize(t)
                else:
                    dst[p.name] = torch.zeros_like(t)
            for refit in range(2):
                reshard.execute_reshard_plan(plan, src, dst, svc, transform)
                torch.cuda.synchronize()
                for name, (data, scales) in want.items():
                    got = dst[name]
                    same_data = torch.equal(got.data, data.view(torch.uint8))
                    same_scales = torch.equal(got.scale, scales.view(torch.uint8))
                    if not (same_data and same_scales):
                        differ = int((got.data != data.view(torch.uint8)).sum())
                        print(f"rank {me}: {src_par} -> {dst_par}, MXFP8 by the {side}, refit "
                              f"{refit}: '{name}' is not Megatron's ({differ} data bytes, scales "
                              f"{'equal' if same_scales else 'differ'})", file=sys.stderr)
                        failures += 1
                    got.data.fill_(0xAB)
                    got.scale.zero_()
            svc.clear_requests()
    svc.finalize()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
