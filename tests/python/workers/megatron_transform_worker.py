"""One rank of a job running a transform written for Megatron-LM's execute_reshard_plan (its hooks:
should_transform(param_name), prepare_send(param_name, src_slice, src_param), prepare_recv(
param_name, dst_slice), finalize_recv(param_name, dst_slice, recv_buffers); new tensors at every
call) through reshard's execute_reshard_plan, unchanged: torch tensors, 4 refits with new weights
(the last through rerun_reshard_plan), every element checked, no refit after the first scheduling
again.

    megatron_transform_worker.py [cpu|cuda]

The transform subclasses Megatron's own base class where the installed megatron-core has one.
"""

import sys

import torch

import reshard

try:
    from megatron.core.resharding.transforms import ReshardTransform as MegatronBase
except ImportError:  # megatron-core before its transforms (0.16): the hooks alone make one
    MegatronBase = object


class HalfOnTheWire(MegatronBase):
    """Sends every 2-D weight as float16 plus its rows' largest magnitudes (two tensors, both new
    at every call); the receiver writes the weight into its own persistent bf16 tensors and the
    maxima beside them, as Megatron's MXFP8 transform writes its persistent buffers."""

    def __init__(self, persistent, row_max):
        self.persistent = persistent  # name -> bf16 tensor (this rank's destination shard)
        self.row_max = row_max  # name -> float32 [rows] beside it
        self.sent = 0

    def should_transform(self, param_name):
        return param_name.endswith("proj.weight")

    def prepare_send(self, param_name, src_slice, src_param):
        assert isinstance(src_slice, tuple) and all(isinstance(s, slice) for s in src_slice)
        block = src_param.data[src_slice]
        self.sent += 1
        return [block.to(torch.float16), block.float().abs().amax(dim=-1)]

    def prepare_recv(self, param_name, dst_slice):
        block = self.persistent[param_name][dst_slice]
        return [torch.empty(block.shape, dtype=torch.float16, device=block.device),
                torch.empty(block.shape[:-1], dtype=torch.float32, device=block.device)]

    def finalize_recv(self, param_name, dst_slice, recv_buffers):
        self.persistent[param_name][dst_slice].copy_(recv_buffers[0].to(torch.bfloat16))
        rows = dst_slice[0]
        current = self.row_max[param_name][rows]
        self.row_max[param_name][rows] = torch.maximum(current, recv_buffers[1])


def full_weight(param, index, refit):
    """The whole weight, exactly representable in float16 (so the wire loses nothing)."""
    n = 1
    for extent in param.shape:
        n *= extent
    values = (torch.arange(n, dtype=torch.int64) * 7 + index * 13 + refit * 5) % 2001 - 1000
    return (values.to(torch.float32) / 8).reshape(tuple(param.shape)).to(torch.bfloat16)


def local_of(layout, rank, name, full, device):
    shape = layout.local_shape(rank, name)
    if shape is None:
        return None
    out = torch.zeros(tuple(shape), dtype=torch.bfloat16, device=device)
    for offset, extent, local_at in layout.pieces(rank, name):
        into = tuple(slice(a, a + e) for a, e in zip(local_at, extent))
        out[into] = full[tuple(slice(o, o + e) for o, e in zip(offset, extent))].to(device)
    return out


def main():
    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    svc = reshard.CopyService(transport="host" if device == "cpu" else "cuda").init("WARN")
    if device == "cuda":
        torch.cuda.set_device(svc.device)
    me, n = svc.my_pe, svc.n_pes
    P = reshard.Parallelism
    failures = 0
    for src_par, dst_par in ((P(tp=n), P(tp=1, replicas=n)), (P(dp=n), P(tp=n)),
                             (P(tp=n // 2, pp=2), P(tp=n))):
        model = reshard.toy_model(2, 128)
        src_layout = reshard.build_layout(model, src_par)
        dst_layout = reshard.build_layout(model, dst_par)
        plan = reshard.make_reshard_plan(src_layout, dst_layout)
        names = [p.name for p in plan.params]
        dst = {name: t for name in names
               if (t := local_of(dst_layout, me, name, torch.zeros(plan.params[names.index(name)].shape,
                                                                  dtype=torch.bfloat16), device))
               is not None}
        row_max = {name: torch.zeros(t.shape[0], dtype=torch.float32, device=device)
                   for name, t in dst.items() if t.dim() == 2}
        transform = HalfOnTheWire(dst, row_max)
        src = {}
        # The last refit through rerun_reshard_plan: the same tensors, their values changed in
        # place, the transform's hooks run again.
        for refit in range(4):
            # A trainer's weights change in place between refits.
            fulls = {p.name: full_weight(p, i, refit) for i, p in enumerate(plan.params)}
            for name in names:
                weights = local_of(src_layout, me, name, fulls[name], device)
                if weights is not None:
                    src.setdefault(name, weights).copy_(weights)
            for t in row_max.values():
                t.zero_()
            if refit < 3:
                report = reshard.execute_reshard_plan(plan, src, dst, svc, transform)
            else:
                report = reshard.rerun_reshard_plan(plan, svc, transform)
            if report.rescheduled != (refit == 0):
                print(f"rank {me}: {src_par} -> {dst_par}: refit {refit} rescheduled="
                      f"{report.rescheduled}", file=sys.stderr)
                failures += 1
            for name, got in dst.items():
                want = local_of(dst_layout, me, name, fulls[name], device)
                if not torch.equal(got, want):
                    print(f"rank {me}: {src_par} -> {dst_par}, refit {refit}: '{name}' differs",
                          file=sys.stderr)
                    failures += 1
                if transform.should_transform(name) and not torch.equal(
                        row_max[name], want.float().abs().amax(dim=-1)):
                    print(f"rank {me}: refit {refit}: the maxima of '{name}' differ",
                          file=sys.stderr)
                    failures += 1
                got.zero_()
        if transform.sent == 0 and any(op.src_pe == me for op in plan.ops
                                       if transform.should_transform(plan.params[op.param].name)):
            print(f"rank {me}: the transform's prepare_send never ran", file=sys.stderr)
            failures += 1
        svc.clear_requests()
    svc.finalize()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
