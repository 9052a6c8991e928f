#!/usr/bin/env python3
"""A PyTorch trainer's FSDP2 state dict into an inference engine's tensor-parallel weights, as a
PyTorch user refits them with reshard.torch, timed beside what colocated frameworks do by hand.

    python -m reshard.launch -n 4 tools/bench/dtensor_refit_bench.py [--layers 16]
        [--trainer 2] [--device cuda|cpu] [--json FILE]

PEs 0 .. T-1 hold a Llama-3-8B-shaped state dict as FSDP2 lays it out (DTensors, Shard(0) over
the trainer mesh; with ``--source fsdp_tp`` FSDP2 over tensor parallel 2, as ``fully_shard`` over
``parallelize_module`` makes it: column-parallel weights ``[_StridedShard(0), Shard(0)]``,
row-parallel ``[Shard(0), Shard(1)]``); the other PEs are the engine, TP over them as vLLM stores its weights (q, k, v
fused into qkv_proj and gate, up into gate_up_proj, column-parallel Shard(0), row-parallel
Shard(1), embeddings and head split by vocabulary, norms whole). PE i is on GPU i mod G: on one
GPU every PE shares it; on G GPUs with 2G PEs and ``--trainer G``, trainer PE i and engine PE
i + G share GPU i (colocated), with ``--trainer G/2`` on G PEs they are on GPUs of their own.
In the same run:

- ``reshard.torch.bind(...)`` once, then ``refit.run()`` (stream=None: waited for);
- the hand-written loop of colocated frameworks: the trainer PEs share their shards through CUDA
  IPC handles (PyTorch's own), every engine PE copies each slice it needs with one ``copy_``
  per slice on its stream, then a barrier;
- where the trainer PEs have a GPU each, each shared with an engine PE: what frameworks do today, ``full_tensor()`` of every
  parameter on the trainer PEs (PyTorch's collectives, NCCL among them), each slice of it the
  engine PE on the same GPU needs copied into that PE's weights (mapped once through CUDA IPC),
  as a hybrid engine loads weights;
- the one-process copy ceiling: the plan's bytes at the rate one process copies 256 MiB on the
  GPU (device to device, best of 5); on several GPUs the lower bound instead: each GPU's bytes to
  and from other GPUs at the one-peer copy-engine rate (256 MiB, GPU 0 to GPU 1), its bytes
  within itself at the device-to-device rate, the busiest GPU's time.

Every destination element is checked after the timed runs. The process group is gloo (NCCL
refuses two ranks on one GPU).
"""

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import time

import reshard


def pattern(torch, numel, device, salt):
    """bf16 bits by global index (finite, distinct nearby), made in chunks."""
    out = torch.empty(numel, dtype=torch.int16, device=device)
    chunk = 1 << 24
    for start in range(0, numel, chunk):
        index = torch.arange(start, min(numel, start + chunk), dtype=torch.int64, device=device)
        out[start:start + chunk] = ((((index + salt) * 2654435761) >> 7) & 0x3FFF).to(torch.int16)
    return out.view(torch.bfloat16)


def llama_params(layers, hidden=4096, kv=1024, ffn=14336, vocab=128256):
    """(name, shape) of a Llama-3-8B-shaped model with `layers` layers, as a trainer names them."""
    params = [("embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"layers.{i}."
        params += [(p + "q_proj.weight", (hidden, hidden)), (p + "k_proj.weight", (kv, hidden)),
                   (p + "v_proj.weight", (kv, hidden)), (p + "o_proj.weight", (hidden, hidden)),
                   (p + "gate_proj.weight", (ffn, hidden)), (p + "up_proj.weight", (ffn, hidden)),
                   (p + "down_proj.weight", (hidden, ffn)),
                   (p + "input_layernorm.weight", (hidden,)),
                   (p + "post_attention_layernorm.weight", (hidden,))]
    params += [("norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return params


def engine_layout(layers):
    """The engine's names: {engine name: (trainer names fused along dim 0, placement)}."""
    out = {"embed_tokens.weight": (["embed_tokens.weight"], "S(0)"),
           "norm.weight": (["norm.weight"], "R"), "lm_head.weight": (["lm_head.weight"], "S(0)")}
    for i in range(layers):
        p = f"layers.{i}."
        out[p + "qkv_proj.weight"] = ([p + "q_proj.weight", p + "k_proj.weight",
                                       p + "v_proj.weight"], "S(0)")
        out[p + "o_proj.weight"] = ([p + "o_proj.weight"], "S(1)")
        out[p + "gate_up_proj.weight"] = ([p + "gate_proj.weight", p + "up_proj.weight"], "S(0)")
        out[p + "down_proj.weight"] = ([p + "down_proj.weight"], "S(1)")
        for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[p + norm] = ([p + norm], "R")
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--trainer", type=int, default=2, help="PEs of the trainer (the first)")
    parser.add_argument("--source", default="fsdp", choices=["fsdp", "fsdp_tp"],
                        help="the trainer's layout: FSDP2, or FSDP2 over tensor parallel 2")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json")
    parser.add_argument("--commit", help="source revision recorded in the JSON line")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    import reshard.torch as rt

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dist.init_process_group("gloo")
    me, n = dist.get_rank(), dist.get_world_size()
    if not 0 < args.trainer < n:
        raise SystemExit(f"--trainer {args.trainer} needs 1 .. {n - 1} of the {n} PEs")
    trainer = list(range(args.trainer))
    engine = list(range(args.trainer, n))
    if args.source == "fsdp_tp" and args.trainer % 2:
        raise SystemExit(f"--source fsdp_tp needs an even --trainer, got {args.trainer}")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    svc = reshard.CopyService("auto" if cuda else "host", "torch",
                              device=device.index if cuda else None).init("WARN")

    params = llama_params(args.layers, vocab=args.vocab)
    shapes = dict(params)
    fused = engine_layout(args.layers)
    tp_dims = {}  # trainer name -> the dim tensor parallelism splits (fsdp_tp), None if whole
    for name, (parts, placement) in fused.items():
        for part in parts:
            tp_dims[part] = {"S(0)": 0, "S(1)": 1}.get(placement)
    if args.source == "fsdp":
        mesh_ranks = torch.tensor(trainer)
    else:
        mesh_ranks = torch.tensor(trainer).view(len(trainer) // 2, 2)

    def placements_of(name):
        if args.source == "fsdp":
            return [Shard(0)]
        tp_dim = tp_dims[name]
        if tp_dim is None:
            return [Shard(0), Replicate()]
        # FSDP2 shards dim 0 of TP's local shard: over a TP-split dim 0 that is _StridedShard.
        return [_StridedShard(0, split_factor=2) if tp_dim == 0 else Shard(0), Shard(tp_dim)]

    def local_of(whole, name):
        """This trainer PE's shard as FSDP2 (over TP) holds it: TP's chunk, then FSDP's."""
        if args.source == "fsdp":
            return whole.chunk(len(trainer), dim=0)[trainer.index(me)]
        dp_at, tp_at = divmod(trainer.index(me), 2)
        tp_dim = tp_dims[name]
        tp_local = whole if tp_dim is None else whole.chunk(2, dim=tp_dim)[tp_at]
        return tp_local.chunk(len(trainer) // 2, dim=0)[dp_at]

    src, dst = {}, {}
    mesh = DeviceMesh(device.type, mesh_ranks, _init_backend=False)
    for i, (name, shape) in enumerate(params):
        if me in trainer:
            whole = pattern(torch, math.prod(shape), device, i).view(shape)
            src[name] = DTensor.from_local(local_of(whole, name).clone(), mesh,
                                           placements_of(name), run_check=False,
                                           shape=torch.Size(shape), stride=whole.stride())
            del whole
    names = {}
    for name, (parts, placement) in fused.items():
        if me in engine:
            t = engine.index(me)
            dim = 1 if placement == "S(1)" else 0
            local_shapes = [list(shapes[p]) for p in parts]
            for s in local_shapes:
                if placement != "R":
                    s[dim] = len(torch.empty(s[dim], device="meta").chunk(len(engine))[t])
            fused_shape = list(local_shapes[0])
            fused_shape[0] = sum(s[0] for s in local_shapes)
            dst[name] = rt.MeshShard(torch.zeros(fused_shape, dtype=torch.bfloat16,
                                                 device=device), engine, [placement])
        names[name] = rt.Fused(parts) if len(parts) > 1 else parts[0]
    if cuda:
        torch.cuda.synchronize()

    def barrier():
        svc.all_gather(b"")

    def slowest(seconds):
        return max(float(x) for x in svc.all_gather(repr(seconds).encode()))

    def time_each(call):
        times = []
        for i in range(args.warmup + args.iters):
            barrier()
            start = time.perf_counter()
            call()
            end = time.perf_counter()
            if i >= args.warmup:
                times.append(slowest(end - start))
        return statistics.median(times)

    barrier()
    started = time.perf_counter()
    refit = rt.bind(src, dst, names=names, service=svc)
    bind_s = slowest(time.perf_counter() - started)
    plan = refit.plan
    total_bytes = plan.stats.total_bytes
    bound = time_each(refit.run)

    # The hand-written loop: trainer shards shared through PyTorch's CUDA IPC, one copy_ per
    # slice on the engine PE's stream, then a barrier.
    loop = None
    copies = mapped = None
    if cuda:
        from torch.multiprocessing.reductions import reduce_tensor

        shared = {plan_name: reduce_tensor(refit.sources[plan_name])
                  for plan_name in refit.sources} if me in trainer else {}
        everyone = [None] * n
        dist.all_gather_object(everyone, shared)
        mapped = {}
        copies = []
        stream = torch.cuda.Stream()
        plan_names = [p.name for p in plan.params]
        for op in plan.ops:
            if op.dst_pe != me:
                continue
            name = plan_names[op.param]
            key = (op.src_pe, name)
            if key not in mapped:
                rebuild, rebuild_args = everyone[op.src_pe][name]
                mapped[key] = rebuild(*rebuild_args)
            source = mapped[key]
            target = refit.destinations[name]
            target = target.data if isinstance(target, reshard.LocalTensor) else target
            src_box = tuple(slice(o, o + e) for o, e in zip(op.src_offset, op.extent))
            dst_box = tuple(slice(o, o + e) for o, e in zip(op.dst_offset, op.extent))
            copies.append((target[dst_box], source[src_box]))

        def copy_loop():
            barrier()
            stream.wait_stream(torch.cuda.current_stream())  # after this PE's own writes
            with torch.cuda.stream(stream):
                for to, frm in copies:
                    to.copy_(frm, non_blocking=True)
            stream.synchronize()
            barrier()

        loop = time_each(copy_loop)

    # What frameworks do: full_tensor() of every parameter on the trainer PEs (NCCL among them,
    # so only where each has a GPU of its own), then the slices the engine PE sharing trainer PE
    # i's GPU (PE i + T) needs, copied into its weights (mapped once through CUDA IPC), as a
    # hybrid engine's load_weights slices the gathered tensor.
    gpus = [int(x) for x in svc.all_gather(repr(device.index if cuda else -1).encode())]
    full = None
    colocated = len(engine) == len(trainer) and all(
        gpus[t] == gpus[e] for t, e in zip(trainer, engine))
    if cuda and colocated and len(set(gpus[:len(trainer)])) == len(trainer):
        from torch.multiprocessing.reductions import reduce_tensor

        if args.source == "fsdp":
            groups = [dist.new_group(trainer, backend="nccl")]
            my_groups = groups
        else:  # FSDP (mesh dim 0) groups, then TP (mesh dim 1) groups, made by every rank
            dp_groups = [dist.new_group(mesh_ranks[:, j].tolist(), backend="nccl")
                         for j in range(2)]
            tp_groups = [dist.new_group(mesh_ranks[i].tolist(), backend="nccl")
                         for i in range(len(trainer) // 2)]
            my_groups = None
            if me in trainer:
                dp_at, tp_at = divmod(trainer.index(me), 2)
                my_groups = [dp_groups[tp_at], tp_groups[dp_at]]
        shared = {name: reduce_tensor(value.local) for name, value in dst.items()}
        everyone = [None] * n
        dist.all_gather_object(everyone, shared)
        full_src, engine_dst = {}, {}
        if me in trainer:
            nccl_mesh = DeviceMesh.from_group(
                my_groups if len(my_groups) > 1 else my_groups[0], "cuda", mesh=mesh_ranks,
                mesh_dim_names=("dp", "tp") if len(my_groups) > 1 else ("dp",))
            for name, value in src.items():
                full_src[name] = DTensor.from_local(value.to_local(), nccl_mesh,
                                                    value.placements, run_check=False,
                                                    shape=value.shape, stride=value.stride())
            partner = engine[trainer.index(me)]
            for name, (rebuild, rebuild_args) in everyone[partner].items():
                engine_dst[name] = rebuild(*rebuild_args)
        everyone = shared = None

        def full_tensor_refit():
            if me in trainer:
                t = trainer.index(me)
                for name, (parts, placement) in fused.items():
                    row = 0
                    for part in parts:
                        whole = full_src[part].full_tensor()
                        piece = whole if placement == "R" else whole.chunk(
                            len(engine), dim=1 if placement == "S(1)" else 0)[t]
                        engine_dst[name][row:row + piece.shape[0]].copy_(piece)
                        row += piece.shape[0]
                torch.cuda.synchronize()
            barrier()

        full = time_each(full_tensor_refit)

    def copy_rate(to_device):
        """Bytes a second of PE 0 copying 256 MiB from its GPU to `to_device` (best of 5)."""
        rate = 0.0
        if me == 0:
            a = torch.empty(256 << 20, dtype=torch.uint8, device=device)
            b = torch.empty_like(a, device=to_device)
            for i in range(6):
                begin = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                begin.record()
                b.copy_(a)
                end.record()
                end.synchronize()
                if i:
                    rate = max(rate, a.numel() / (begin.elapsed_time(end) * 1e-3))
            del a, b
        return max(float(x) for x in svc.all_gather(repr(rate).encode()))

    ceiling_s = None
    lower_bound_s = None
    if cuda:  # PE 0 copies while the others wait at the all-gather
        local_rate = copy_rate(device)
        ceiling_s = total_bytes / local_rate if local_rate else None
        if len(set(gpus)) > 1:
            # Each GPU's bytes to and from other GPUs at the one-peer copy-engine rate, its
            # bytes within itself at the device-to-device rate; the busiest GPU bounds the refit.
            other = next(g for g in sorted(set(gpus)) if g != gpus[0])
            peer_rate = copy_rate(torch.device("cuda", other))
            out_bytes, in_bytes, within = {}, {}, {}
            for op in plan.ops:
                a, b = gpus[op.src_pe], gpus[op.dst_pe]
                if a == b:
                    within[a] = within.get(a, 0) + op.bytes
                else:
                    out_bytes[a] = out_bytes.get(a, 0) + op.bytes
                    in_bytes[b] = in_bytes.get(b, 0) + op.bytes
            lower_bound_s = max(max(max(out_bytes.get(g, 0), in_bytes.get(g, 0)) / peer_rate,
                                    within.get(g, 0) / local_rate) for g in set(gpus))

    index = {name: i for i, (name, _) in enumerate(params)}

    def wrong_after(refit_once):
        """Destination elements that differ from the trainer's after zeroing them all and one
        more refit (the slowest PE's count)."""
        for value in dst.values():
            value.local.zero_()
        refit_once()
        wrong = 0
        for name, (parts, placement) in fused.items():
            if me not in engine:
                break
            t = engine.index(me)
            expected = []
            for part in parts:
                whole = pattern(torch, math.prod(shapes[part]), device,
                                index[part]).view(shapes[part])
                expected.append(whole if placement == "R" else
                                whole.chunk(len(engine), dim=1 if placement == "S(1)" else 0)[t])
            want = torch.cat(expected, dim=0)
            wrong += int((dst[name].local.view(torch.int16) != want.view(torch.int16)).sum())
        return int(max(float(x) for x in svc.all_gather(repr(float(wrong)).encode())))

    wrong = wrong_after(refit.run)
    loop_wrong = wrong_after(copy_loop) if loop is not None else 0
    full_wrong = wrong_after(full_tensor_refit) if full is not None else 0

    # The engine PEs let go of the trainer's memory before the trainer PEs may exit.
    copies = mapped = None
    if full is not None:
        full_src = engine_dst = None
        torch.cuda.synchronize()
    barrier()

    if me == 0:
        mib = total_bytes / 2**20
        source = "FSDP2 Shard(0)" if args.source == "fsdp" else "FSDP2 over TP 2"
        print(f"dtensor refit: Llama-3-8B shape ({args.layers} layers), {source} on PEs "
              f"{trainer} -> TP {len(engine)} (qkv, gate_up fused) on PEs {engine}, "
              f"{mib:.0f} MiB moved, transport {svc.transport}, torch {torch.__version__} "
              f"on {args.device}" + (f" ({len(set(gpus))} GPUs)" if len(set(gpus)) > 1 else ""))
        print(f"  reshard.torch.bind (once):            {bind_s * 1e3:.1f} ms")
        print(f"  refit.run():                          {bound * 1e3:.3f} ms")
        if loop is not None:
            print(f"  IPC copy loop ({len(plan.ops)} slices): {loop * 1e3:.3f} ms "
                  f"(reshard {loop / bound:.2f}x faster)")
        if full is not None:
            print(f"  full_tensor() + slice copies:         {full * 1e3:.3f} ms "
                  f"(reshard {full / bound:.2f}x faster)")
        if lower_bound_s is not None:
            print(f"  lower bound (busiest GPU):            {lower_bound_s * 1e3:.3f} ms "
                  f"(reshard at {lower_bound_s / bound:.2f} of it)")
        elif ceiling_s is not None:
            print(f"  one-process copy ceiling:             {ceiling_s * 1e3:.3f} ms "
                  f"(reshard at {ceiling_s / bound:.2f} of it)")
        print(f"  wrong destination elements (slowest PE): reshard {wrong}, copy loop "
              f"{loop_wrong}, full_tensor {full_wrong}")
        if args.json:
            commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                   capture_output=True, text=True).stdout.strip()
            record = {"bench": "dtensor_refit", "date": datetime.date.today().isoformat(),
                      "commit": commit, "model": "llama3-8b-shape", "layers": args.layers,
                      "source": args.source, "gpus": len(set(gpus)),
                      "pes": n, "trainer_pes": trainer, "engine_pes": engine,
                      "bytes": total_bytes, "transport": svc.transport,
                      "cuda_engine": os.environ.get("RESHARD_CUDA_ENGINE", "auto"),
                      "same_device": os.environ.get("RESHARD_CUDA_SAME_DEVICE", "auto"),
                      "mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")),
                      "device": torch.cuda.get_device_name() if cuda else "host",
                      "torch": torch.__version__, "bind_s": bind_s, "run_median_s": bound,
                      "ipc_copy_loop_median_s": loop, "copy_ceiling_s": ceiling_s,
                      "full_tensor_median_s": full, "lower_bound_s": lower_bound_s,
                      "staging_bytes": getattr(refit.report, "staging_bytes", None),
                      "wrong": wrong, "copy_loop_wrong": loop_wrong,
                      "full_tensor_wrong": full_wrong}
            with open(args.json, "a") as out:
                out.write(json.dumps(record) + "\n")
    refit.close()
    svc.finalize()
    dist.destroy_process_group()
    return 1 if wrong or loop_wrong or full_wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
