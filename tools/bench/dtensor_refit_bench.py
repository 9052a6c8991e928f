#!/usr/bin/env python3
"""A PyTorch trainer's FSDP2 state dict into an inference engine's tensor-parallel weights, as a
PyTorch user refits them with reshard.torch, timed beside what colocated frameworks do by hand.

    python -m reshard.launch -n 4 tools/bench/dtensor_refit_bench.py [--layers 16]
        [--trainer 2] [--device cuda|cpu] [--json FILE]

PEs 0 .. T-1 hold a Llama-3-8B-shaped state dict as FSDP2 lays it out (DTensors, Shard(0) over
the trainer mesh); the other PEs are the engine, TP over them as vLLM stores its weights (q, k, v
fused into qkv_proj and gate, up into gate_up_proj, column-parallel Shard(0), row-parallel
Shard(1), embeddings and head split by vocabulary, norms whole). On one GPU every PE shares it.
In the same run:

- ``reshard.torch.bind(...)`` once, then ``refit.run()`` (stream=None: waited for);
- the hand-written loop of colocated frameworks: the trainer PEs share their shards through CUDA
  IPC handles (PyTorch's own), every engine PE copies each slice it needs with one ``copy_``
  per slice on its stream, then a barrier;
- the one-process copy ceiling: the plan's bytes at the rate one process copies 256 MiB on the
  GPU (device to device, best of 5).

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
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json")
    parser.add_argument("--commit", help="source revision recorded in the JSON line")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

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
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    svc = reshard.CopyService("auto" if cuda else "host", "torch",
                              device=device.index if cuda else None).init("WARN")

    params = llama_params(args.layers, vocab=args.vocab)
    shapes = dict(params)
    fused = engine_layout(args.layers)
    src, dst = {}, {}
    mesh = DeviceMesh(device.type, trainer, _init_backend=False)
    for i, (name, shape) in enumerate(params):
        if me in trainer:
            whole = pattern(torch, math.prod(shape), device, i).view(shape)
            local = whole.chunk(len(trainer), dim=0)[trainer.index(me)].clone()
            src[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
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
            if op.dst_rank != me:
                continue
            name = plan_names[op.param]
            key = (op.src_rank, name)
            if key not in mapped:
                rebuild, rebuild_args = everyone[op.src_rank][name]
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

    ceiling_s = None
    if cuda:  # PE 0 copies while the others wait at the all-gather below
        rate = 0.0
        if me == 0:
            a = torch.empty(256 << 20, dtype=torch.uint8, device=device)
            b = torch.empty_like(a)
            for i in range(6):
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                b.copy_(a)
                end.record()
                end.synchronize()
                if i:
                    rate = max(rate, a.numel() / (begin.elapsed_time(end) * 1e-3))
            del a, b
        rate = max(float(x) for x in svc.all_gather(repr(rate).encode()))
        ceiling_s = total_bytes / rate if rate else None

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

    # The engine PEs let go of the trainer's memory before the trainer PEs may exit.
    copies = mapped = None
    barrier()

    if me == 0:
        mib = total_bytes / 2**20
        print(f"dtensor refit: Llama-3-8B shape ({args.layers} layers), FSDP2 Shard(0) on PEs "
              f"{trainer} -> TP {len(engine)} (qkv, gate_up fused) on PEs {engine}, "
              f"{mib:.0f} MiB moved, transport {svc.transport}, torch {torch.__version__} "
              f"on {args.device}")
        print(f"  reshard.torch.bind (once):            {bind_s * 1e3:.1f} ms")
        print(f"  refit.run():                          {bound * 1e3:.3f} ms")
        if loop is not None:
            print(f"  IPC copy loop ({len(plan.ops)} slices): {loop * 1e3:.3f} ms "
                  f"(reshard {loop / bound:.2f}x faster)")
        if ceiling_s is not None:
            print(f"  one-process copy ceiling:             {ceiling_s * 1e3:.3f} ms "
                  f"(reshard at {ceiling_s / bound:.2f} of it)")
        print(f"  wrong destination elements (slowest PE): reshard {wrong}, copy loop "
              f"{loop_wrong}")
        if args.json:
            commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                   capture_output=True, text=True).stdout.strip()
            record = {"bench": "dtensor_refit", "date": datetime.date.today().isoformat(),
                      "commit": commit, "model": "llama3-8b-shape", "layers": args.layers,
                      "pes": n, "trainer_pes": trainer, "engine_pes": engine,
                      "bytes": total_bytes, "transport": svc.transport,
                      "cuda_engine": os.environ.get("RESHARD_CUDA_ENGINE", "auto"),
                      "same_device": os.environ.get("RESHARD_CUDA_SAME_DEVICE", "auto"),
                      "mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")),
                      "device": torch.cuda.get_device_name() if cuda else "host",
                      "torch": torch.__version__, "bind_s": bind_s, "run_median_s": bound,
                      "ipc_copy_loop_median_s": loop, "copy_ceiling_s": ceiling_s,
                      "staging_bytes": getattr(refit.report, "staging_bytes", None),
                      "wrong": wrong, "copy_loop_wrong": loop_wrong}
            with open(args.json, "a") as out:
                out.write(json.dumps(record) + "\n")
    refit.close()
    svc.finalize()
    dist.destroy_process_group()
    return 1 if wrong or loop_wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
