#!/usr/bin/env python3
"""A model refit as a Python user runs it, with PyTorch tensors, timed per call on the slowest PE.

    python -m reshard.launch -n 2 tools/bench/python_refit_bench.py [--model qwen3-30b-a3b]
        [--layers 12] [--device cuda|cpu] [--staged] [--groups] [--graph] [--json FILE]

The layouts are `reshard bench-refit`'s (Llama-3-8B TP n -> TP n/2 x 2 replicas; Qwen3-30B-A3B
TP n/2 x DP 2 x EP n -> TP n x EP n/2 x expert-TP 2), so the figures stand beside its C++ ones
from the same machine: ``execute_reshard_plan`` with the same dicts every call, ``bind()`` once
then ``run()`` (stream=None: ordered after PyTorch's current stream, waited for), the same
``run()`` queued on a stream (host time of the call alone, and the refit waited for), and
``rerun_reshard_plan``. Every destination of a sample of parameters is checked element by element
after the timed runs (bf16 moves bit for bit; MXFP8 destinations are checked by the GPU tests).
"""

import argparse
import ctypes
import datetime
import functools
import json
import math
import statistics
import subprocess
import time

import reshard


def layouts(model: str, n: int):
    if n < 2 or n % 2:
        raise SystemExit(f"needs an even number of PEs, got {n}")
    if model == "qwen3-30b-a3b":
        return (reshard.Parallelism(tp=n // 2, dp=2, ep=n),
                reshard.Parallelism(tp=n, ep=n // 2, etp=2))
    return reshard.Parallelism(tp=n), reshard.Parallelism(tp=n // 2, replicas=2)


def pattern(torch, numel: int, device) -> "torch.Tensor":
    """A parameter's elements by global index, as bf16 bits (finite, all different nearby);
    made in chunks, so a vocabulary-sized parameter needs little more than its own memory."""
    out = torch.empty(numel, dtype=torch.int16, device=device)
    chunk = 1 << 24
    for start in range(0, numel, chunk):
        index = torch.arange(start, min(numel, start + chunk), dtype=torch.int64, device=device)
        out[start:start + chunk] = (((index * 2654435761) >> 7) & 0x3FFF).to(torch.int16)
    return out.view(torch.bfloat16)


def blocks(layout, me, name):
    for offset, extent, local_at in layout.pieces(me, name):
        yield (tuple(slice(o, o + e) for o, e in zip(offset, extent)),
               tuple(slice(o, o + e) for o, e in zip(local_at, extent)))


# CUgraphNodeType, in the driver's order.
NODE_KINDS = ["kernel", "memcpy", "memset", "host", "graph", "empty", "wait_event",
              "event_record", "ext_semas_signal", "ext_semas_wait", "mem_alloc", "mem_free",
              "batch_mem_op", "conditional"]


def graph_nodes_by_kind(driver, graph) -> dict:
    """The captured graph's nodes counted by kind (the driver's cuGraphGetNodes and
    cuGraphNodeGetType on torch's raw graph): what a replay launches."""
    raw = ctypes.c_void_p(graph.raw_cuda_graph())
    count = ctypes.c_size_t(0)
    if driver.cuGraphGetNodes(raw, None, ctypes.byref(count)) != 0:
        raise RuntimeError("cuGraphGetNodes failed")
    nodes = (ctypes.c_void_p * count.value)()
    driver.cuGraphGetNodes(raw, nodes, ctypes.byref(count))
    kinds: dict = {}
    for node in nodes:
        kind = ctypes.c_int(0)
        driver.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind))
        name = NODE_KINDS[kind.value] if kind.value < len(NODE_KINDS) else str(kind.value)
        kinds[name] = kinds.get(name, 0) + 1
    return kinds


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-30b-a3b",
                        choices=["qwen3-30b-a3b", "llama3-8b", "toy"])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--transport", default="auto")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--staged", action="store_true",
                        help="also a staged refit: stage(), commit() and both, timed apart")
    parser.add_argument("--groups", action="store_true",
                        help="also the refit bound with groups='layers': a whole run, and a "
                             "loop running one group at a time")
    parser.add_argument("--graph", action="store_true",
                        help="also the bound run captured once in a CUDA graph "
                             "(torch.cuda.graph) and replayed: host time of a replay")
    parser.add_argument("--json")
    parser.add_argument("--commit", help="source revision recorded in the JSON line")
    args = parser.parse_args()

    import torch

    svc = reshard.CopyService(args.transport).init("WARN")
    me, n = svc.my_pe, svc.n_pes
    device = torch.device(f"cuda:{svc.device}" if args.device == "cuda" else "cpu")
    if args.device == "cuda":
        torch.cuda.set_device(device)
    spec = {"qwen3-30b-a3b": reshard.qwen3_30b_a3b_model, "llama3-8b": reshard.llama3_8b_model,
            "toy": lambda layers: reshard.toy_model(layers, 512)}[args.model](args.layers)
    src_par, dst_par = layouts(args.model, n)
    plan = reshard.make_reshard_plan(reshard.build_layout(spec, src_par),
                                     reshard.build_layout(spec, dst_par))
    src, dst = {}, {}
    for p in plan.params:
        shape = plan.src_layout.local_shape(me, p.name)
        if shape is not None:
            whole = pattern(torch, math.prod(p.shape), device).view(p.shape)
            local = torch.empty(shape, dtype=torch.bfloat16, device=device)
            for glob, loc in blocks(plan.src_layout, me, p.name):
                local[loc] = whole[glob]
            src[p.name] = local
            del whole
        shape = plan.dst_layout.local_shape(me, p.name)
        if shape is not None:
            dst[p.name] = torch.zeros(shape, dtype=torch.bfloat16, device=device)
    if args.device == "cuda":
        torch.cuda.synchronize()

    def barrier():
        svc.all_gather(b"")

    def slowest(seconds: float) -> float:
        return max(float(x) for x in svc.all_gather(repr(seconds).encode()))

    def time_each(call, wait=None):
        """Median over PEs' slowest time per call (and, with `wait`, of the call alone)."""
        total, issued = [], []
        for i in range(args.warmup + args.iters):
            barrier()
            start = time.perf_counter()
            call()
            returned = time.perf_counter()
            if wait is not None:
                wait()
            end = time.perf_counter()
            if i >= args.warmup:
                total.append(slowest(end - start))
                issued.append(slowest(returned - start))
        return statistics.median(total), statistics.median(issued)

    executed, _ = time_each(lambda: reshard.execute_reshard_plan(plan, src, dst, svc))
    rerun, _ = time_each(lambda: reshard.rerun_reshard_plan(plan, svc))
    refit = reshard.bind(plan, src, dst, svc)
    bound, _ = time_each(refit.run)
    queued = issued = None
    if args.device == "cuda":
        # A stream of its own: the default stream's handle is 0, which means "no stream" (the
        # call then waits for the bytes) to every CUDA API and to reshard.
        stream = torch.cuda.Stream()
        queued, issued = time_each(lambda: refit.run(stream), stream.synchronize)

    # Every destination element of a sample of parameters: first, last and spread between.
    names = sorted(dst)
    sample = set(names[:: max(1, len(names) // 24)] + names[-2:])

    def wrong_after(refit_once):
        """Sampled destination elements that differ after zeroing every destination and one
        more refit (the slowest PE's count)."""
        for tensor in dst.values():
            tensor.zero_()
        refit_once()
        wrong = 0
        for name in sample:
            p = next(q for q in plan.params if q.name == name)
            whole = pattern(torch, math.prod(p.shape), device).view(p.shape)
            for glob, loc in blocks(plan.dst_layout, me, name):
                wrong += int((dst[name][loc].view(torch.int16) !=
                              whole[glob].view(torch.int16)).sum())
        return int(max(float(x) for x in svc.all_gather(repr(float(wrong)).encode())))

    wrong = wrong_after(refit.run)

    # Captured once, replayed: what an engine that captures its refit in a graph pays a refit.
    graphed = None
    if args.graph and args.device == "cuda":
        with torch.cuda.stream(stream):
            refit.run(stream)
        stream.synchronize()
        barrier()
        graph = torch.cuda.CUDAGraph(keep_graph=True)  # kept: its nodes are counted
        with torch.cuda.graph(graph, stream=stream):
            refit.run(stream)
        graph.instantiate()
        driver = ctypes.CDLL("libcuda.so.1")
        nodes = graph_nodes_by_kind(driver, graph)
        barrier()

        def replay_waited():
            graph.replay()  # on the current stream, as torch replays
            torch.cuda.synchronize()

        replayed, replay_issued = time_each(graph.replay, torch.cuda.synchronize)
        # The same graph launched through the driver alone (cuGraphLaunch), and a graph of one
        # small PyTorch kernel replayed: which part of a replay's host time is whose.
        graph_exec = ctypes.c_void_p(graph.raw_cuda_graph_exec())
        current = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        _, driver_issued = time_each(lambda: driver.cuGraphLaunch(graph_exec, current),
                                     torch.cuda.synchronize)
        scratch = torch.zeros(1024, device=device)
        small = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(small, stream=stream):
            scratch.add_(1)
        small.instantiate()
        _, small_issued = time_each(small.replay, torch.cuda.synchronize)
        small_exec = ctypes.c_void_p(small.raw_cuda_graph_exec())
        _, small_driver = time_each(lambda: driver.cuGraphLaunch(small_exec, current),
                                    torch.cuda.synchronize)

        def launch_after(before, launch=lambda: driver.cuGraphLaunch(graph_exec, current)):
            """Host time of `launch()` (cuGraphLaunch of the refit's graph) right after
            `before()`."""
            spans = []
            for i in range(args.warmup + args.iters):
                barrier()
                before()
                start = time.perf_counter()
                launch()
                span = time.perf_counter() - start
                torch.cuda.synchronize()
                if i >= args.warmup:
                    spans.append(slowest(span))
            return statistics.median(spans)

        def spin(seconds):
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                pass

        # Which part of the launch's host time is the refit graph's own: right after a launch of
        # the small graph (the driver's launch path warm) and after a millisecond of host spinning
        # instead of the barrier's sleep in a socket read.
        after_small = launch_after(lambda: driver.cuGraphLaunch(small_exec, current))
        after_spin = launch_after(lambda: spin(1e-3))
        after_itself = launch_after(lambda: driver.cuGraphLaunch(graph_exec, current))
        wrong += wrong_after(replay_waited)
        torch_after_itself = launch_after(graph.replay, graph.replay)
        # reshard's own capture of the same run: RefitGraph.replay() is one launch from Python.
        native = refit.capture_graph(stream)
        handle = stream.cuda_stream
        native_replay = functools.partial(native.replay, handle)  # no Python frame around it
        native_replayed, native_issued = time_each(native_replay, stream.synchronize)
        native_after_small = launch_after(lambda: driver.cuGraphLaunch(small_exec, current),
                                          native_replay)
        native_after_itself = launch_after(native_replay, native_replay)
        def native_replay_waited():  # after the zeroing queued on the current stream
            stream.wait_stream(torch.cuda.current_stream())
            native_replay()
            stream.synchronize()

        wrong += wrong_after(native_replay_waited)
        graphed = {"replay": replayed, "host": replay_issued, "nodes": nodes,
                   "driver_host": driver_issued, "small_host": small_issued,
                   "small_driver_host": small_driver, "driver_after_small": after_small,
                   "driver_after_spin": after_spin, "driver_after_itself": after_itself,
                   "torch_after_itself": torch_after_itself, "native_replay": native_replayed,
                   "native_host": native_issued, "native_after_small": native_after_small,
                   "native_after_itself": native_after_itself}

    # Staged (after the checks above: binding it replaces the bound refit's schedule on svc).
    staged = None
    if args.staged:
        refit.close()
        staged_refit = reshard.bind(plan, src, dst, svc, staged=True)
        stage_s, _ = time_each(staged_refit.stage)
        staged_refit.stage()
        _, commit_s = time_each(staged_refit.commit, staged_refit.stage)  # the pause alone
        both_s, _ = time_each(staged_refit.run)
        wrong += wrong_after(staged_refit.run)
        staged = {"stage": stage_s, "commit": commit_s, "both": both_s,
                  "bytes": staged_refit.staged_bytes}
        staged_refit.close()

    # One group per layer (after the checks above, as the staged refit).
    grouped = None
    if args.groups:
        refit.close()
        grouped_refit = reshard.bind(plan, src, dst, svc, groups="layers")
        names = grouped_refit.groups
        per_group = {name: [] for name in names}

        def loop():
            for name in names:
                start = time.perf_counter()
                grouped_refit.run(groups=name)
                per_group[name].append(time.perf_counter() - start)

        whole_s, _ = time_each(grouped_refit.run)
        loop_s, _ = time_each(loop)
        wrong += wrong_after(loop)
        grouped = {"whole": whole_s, "loop": loop_s, "groups": len(names),
                   "per_group": {name: statistics.median(t) for name, t in per_group.items()}}
        if args.device == "cuda":
            # The loop as an engine overlapping it with its own work writes it: each group queued
            # on a stream as the one before it runs, one wait at the end.
            def queued_loop():
                for name in names:
                    grouped_refit.run(stream, groups=name)

            grouped["queued_loop"], _ = time_each(queued_loop, stream.synchronize)
            wrong += wrong_after(
                lambda: (torch.cuda.synchronize(), queued_loop(), stream.synchronize()))
        grouped_refit.close()
        if args.staged:
            # A group at a time, staged: the pause an engine takes is one group's commit().
            staged_groups = reshard.bind(plan, src, dst, svc, staged=True, groups="layers")
            commits = []

            def stage_then_commit_each():
                for name in names:
                    staged_groups.stage(groups=name)
                    barrier()
                    start = time.perf_counter()
                    staged_groups.commit(groups=name)
                    commits.append(slowest(time.perf_counter() - start))

            for _ in range(args.warmup):
                stage_then_commit_each()
            commits.clear()
            for _ in range(args.iters):
                stage_then_commit_each()
            wrong += wrong_after(stage_then_commit_each)
            grouped["commit_each"] = statistics.median(commits)
            grouped["commit_each_max"] = max(commits)
            staged_groups.close()

    if me == 0:
        print(f"python refit: {spec.name} ({args.layers} layers), {src_par} -> {dst_par} on {n} "
              f"PEs, transport {svc.transport}, torch {torch.__version__} on {args.device}")
        print(f"  execute_reshard_plan (same dicts each call): {executed * 1e3:.3f} ms")
        print(f"  rerun_reshard_plan:                          {rerun * 1e3:.3f} ms")
        print(f"  bind() once, run() (stream=None, waited):    {bound * 1e3:.3f} ms "
              f"({executed / bound:.2f}x faster than execute)")
        if queued is not None:
            print(f"  run(stream) then synchronize:                {queued * 1e3:.3f} ms "
                  f"(host time of the call {issued * 1e6:.1f} us)")
        if graphed is not None:
            print(f"  CUDA graph replay then synchronize:          "
                  f"{graphed['replay'] * 1e3:.3f} ms (host time of replay() "
                  f"{graphed['host'] * 1e6:.1f} us); nodes on PE 0: "
                  + ", ".join(f"{count} {kind}" for kind, count in graphed["nodes"].items()))
            print(f"    host time of cuGraphLaunch of it alone {graphed['driver_host'] * 1e6:.1f} us"
                  f" (right after a small graph's launch {graphed['driver_after_small'] * 1e6:.1f}"
                  f" us, after 1 ms of host spinning {graphed['driver_after_spin'] * 1e6:.1f} us,"
                  f" right after its own launch {graphed['driver_after_itself'] * 1e6:.1f} us);"
                  f" of a one-kernel PyTorch graph: replay() {graphed['small_host'] * 1e6:.1f} us,"
                  f" cuGraphLaunch {graphed['small_driver_host'] * 1e6:.1f} us")
            print(f"  RefitGraph.replay() then synchronize:        "
                  f"{graphed['native_replay'] * 1e3:.3f} ms (host time of replay() "
                  f"{graphed['native_host'] * 1e6:.1f} us, right after a small graph's launch "
                  f"{graphed['native_after_small'] * 1e6:.1f} us, right after its own "
                  f"{graphed['native_after_itself'] * 1e6:.1f} us; torch's replay() right "
                  f"after its own {graphed['torch_after_itself'] * 1e6:.1f} us)")
        if staged is not None:
            print(f"  staged: stage() {staged['stage'] * 1e3:.3f} ms, commit() (the pause) "
                  f"{staged['commit'] * 1e3:.3f} ms = {staged['commit'] / bound:.2f}x the run, "
                  f"stage+commit {staged['both'] * 1e3:.3f} ms = {staged['both'] / bound:.2f}x; "
                  f"{staged['bytes'] / 2**20:.0f} MiB staged on PE 0")
        if grouped is not None:
            print(f"  groups='layers' ({grouped['groups']} groups): a whole run "
                  f"{grouped['whole'] * 1e3:.3f} ms = {grouped['whole'] / bound:.2f}x the "
                  f"ungrouped run; a group at a time {grouped['loop'] * 1e3:.3f} ms = "
                  f"{grouped['loop'] / bound:.2f}x (waited each)"
                  + (f", {grouped['queued_loop'] * 1e3:.3f} ms = "
                     f"{grouped['queued_loop'] / bound:.2f}x (queued on a stream)"
                     if "queued_loop" in grouped else ""))
            if "commit_each" in grouped:
                print(f"  staged a group at a time: one group's commit() (the pause) median "
                      f"{grouped['commit_each'] * 1e6:.1f} us, longest "
                      f"{grouped['commit_each_max'] * 1e6:.1f} us = "
                      f"{grouped['commit_each_max'] / bound:.3f}x the whole run")
        print(f"  wrong elements in {len(sample)} sampled destinations (slowest PE): {wrong}")
        if args.json:
            commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                   capture_output=True, text=True).stdout.strip()
            record = {"bench": "python_refit", "date": datetime.date.today().isoformat(),
                      "commit": commit, "model": spec.name, "layers": args.layers, "pes": n,
                      "src": str(src_par), "dst": str(dst_par), "transport": svc.transport,
                      "device": (torch.cuda.get_device_name() if args.device == "cuda"
                                 else "host"),
                      "execute_median_s": executed, "rerun_median_s": rerun,
                      "bound_median_s": bound, "bound_stream_median_s": queued,
                      "bound_issue_median_s": issued, "wrong": wrong}
            if graphed is not None:
                record.update({"graph_replay_median_s": graphed["replay"],
                               "graph_replay_host_median_s": graphed["host"],
                               "graph_nodes_pe0": graphed["nodes"],
                               "graph_driver_launch_host_median_s": graphed["driver_host"],
                               "small_graph_replay_host_median_s": graphed["small_host"],
                               "small_graph_driver_launch_host_median_s":
                                   graphed["small_driver_host"],
                               "graph_driver_launch_after_small_host_median_s":
                                   graphed["driver_after_small"],
                               "graph_driver_launch_after_spin_host_median_s":
                                   graphed["driver_after_spin"],
                               "graph_driver_launch_after_itself_host_median_s":
                                   graphed["driver_after_itself"],
                               "graph_replay_after_itself_host_median_s":
                                   graphed["torch_after_itself"],
                               "refit_graph_replay_median_s": graphed["native_replay"],
                               "refit_graph_replay_host_median_s": graphed["native_host"],
                               "refit_graph_replay_after_small_host_median_s":
                                   graphed["native_after_small"],
                               "refit_graph_replay_after_itself_host_median_s":
                                   graphed["native_after_itself"]})
            if staged is not None:
                record.update({"staged_stage_median_s": staged["stage"],
                               "staged_commit_median_s": staged["commit"],
                               "staged_both_median_s": staged["both"],
                               "staged_bytes_pe0": staged["bytes"]})
            if grouped is not None:
                record.update({"groups": grouped["groups"],
                               "grouped_whole_median_s": grouped["whole"],
                               "grouped_loop_median_s": grouped["loop"],
                               "grouped_per_group_median_s": grouped["per_group"]})
                for key, field in (("queued_loop", "grouped_queued_loop_median_s"),
                                   ("commit_each", "grouped_staged_commit_median_s"),
                                   ("commit_each_max", "grouped_staged_commit_max_s")):
                    if key in grouped:
                        record[field] = grouped[key]
            with open(args.json, "a") as out:
                out.write(json.dumps(record) + "\n")
    svc.finalize()
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
