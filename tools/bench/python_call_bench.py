#!/usr/bin/env python3
"""The host time a Python call of ``execute_reshard_plan`` spends on its tensors.

    python3 tools/bench/python_call_bench.py [--layers 48] [--experts 128] [--kind torch]

One PE on the host transport, a toy MoE of thousands of small tensors refitted onto the same
layout: each call of ``execute_reshard_plan`` converts every source and destination tensor and
checks it against the schedule, where ``rerun_reshard_plan`` runs the same refit with nothing
converted or checked. The difference of the means, per tensor, is what a Python caller pays per
parameter and refit; the time Python's garbage collector ran during the calls is part of it; the
median of the calls' own time checking the tensors (``ReshardReport.timing.check_seconds``) is printed
beside it. ``--kind``: ``torch`` (plain tensors), ``parameter`` (``torch.nn.Parameter``, which
require gradients), ``numpy`` (uint16 arrays as ``LocalTensor(..., dtype="bfloat16")``). ``--api
megatron`` times Megatron's copy-service interface instead: ``ReshardCopyService`` with every
tensor submitted to be sent and received (to this PE) and ``run()``, as Megatron's refit calls it,
per refit (its tensors persistent, so no refit copies them; ``--fresh``: new ones every refit, as
Megatron's refit makes them, copied into those registered first and back). ``--json FILE`` appends
the result as a JSON line.
"""

import argparse
import datetime
import gc
import itertools
import json
import statistics
import subprocess
import time

import numpy as np

import reshard


def tensors(layout, plan, kind):
    shapes = {param.name: layout.local_shape(0, param.name) for param in plan.params}
    if kind == "numpy":
        return {name: reshard.LocalTensor(np.zeros(shape, np.uint16), dtype="bfloat16")
                for name, shape in shapes.items()}
    import torch

    wrap = torch.nn.Parameter if kind == "parameter" else (lambda tensor: tensor)
    return {name: wrap(torch.zeros(shape, dtype=torch.bfloat16)) for name, shape in shapes.items()}


class GarbageCollectorClock:
    """Time spent in Python's garbage collector while it is entered (gc.callbacks)."""

    def __init__(self):
        self.seconds, self._start = 0.0, 0.0

    def __call__(self, phase, info):
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)


def timed_ms(call, calls):
    """Mean and median of `calls` calls, and the collector's time a call, in ms. The mean counts
    the collections that a median of calls can leave out (they land on some calls only)."""
    times = []
    with GarbageCollectorClock() as collector:
        for _ in range(calls):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
    return (statistics.mean(times) * 1e3, statistics.median(times) * 1e3,
            collector.seconds / calls * 1e3)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--kind", choices=["torch", "parameter", "numpy"], default="torch")
    parser.add_argument("--calls", type=int, default=21)
    parser.add_argument("--update", type=int, default=64,
                        help="tensors handed to each timed update() of the bound refit")
    parser.add_argument("--json", help="append the result to this JSON-lines file")
    parser.add_argument("--commit", help="source revision recorded in the JSON line")
    parser.add_argument("--api", choices=["execute", "megatron"], default="execute")
    parser.add_argument("--fresh", action="store_true",
                        help="with --api megatron: new tensors every refit, as Megatron hands "
                             "them over (copied into the registered ones and back)")
    args = parser.parse_args()
    if args.api == "megatron":
        return megatron_refits(args)

    service = reshard.CopyService(transport="host").init("WARN")
    layout = reshard.build_layout(reshard.toy_model(args.layers, 64, args.experts),
                                  reshard.Parallelism())
    plan = reshard.make_reshard_plan(layout, layout)
    src, dst = tensors(layout, plan, args.kind), tensors(layout, plan, args.kind)
    for _ in range(3):  # the first call schedules
        reshard.execute_reshard_plan(plan, src, dst, service)
    checks = []  # each execute's host time checking the tensors (ReshardReport.timing.check_seconds)
    execute, execute_median, collector = timed_ms(
        lambda: checks.append(
            reshard.execute_reshard_plan(plan, src, dst, service).timing.check_seconds * 1e3),
        args.calls)
    check_median = statistics.median(checks)
    rerun, rerun_median, _ = timed_ms(lambda: reshard.rerun_reshard_plan(plan, service), args.calls)
    # New dicts of the same tensors at every call (as a framework builds them from its modules):
    # the entries are compared by name.
    rebuilt, rebuilt_median, _ = timed_ms(
        lambda: reshard.execute_reshard_plan(plan, dict(src), dict(dst), service), args.calls)
    # Bound once: run() with nothing converted, checked or agreed; update() of a few tensors that
    # did not change (one small collective).
    refit = reshard.bind(plan, src, dst, service)
    bound, bound_median, _ = timed_ms(refit.run, args.calls)
    few = dict(list(src.items())[:args.update])
    update, update_median, _ = timed_ms(lambda: refit.update(src=few), args.calls)
    refit.close()
    # The same-dicts check alone: the one C++ pass that compares a call's dicts with the last
    # call's (names, objects, each array's address read again), per array of src and dst.
    snapshot = reshard._core.TensorSnapshot(src, dst, reshard.LocalTensor)
    passes = []
    for _ in range(200):
        start = time.perf_counter()
        if not snapshot.matches(src, dst):
            raise SystemExit("the same dicts did not match their own snapshot")
        passes.append(time.perf_counter() - start)
    arrays = len(src) + len(dst)
    check_ns, check_fastest_ns = (statistics.median(passes) / arrays * 1e9,
                                  min(passes) / arrays * 1e9)
    count = len(plan.params)
    per_tensor_us = (execute - rerun) / count * 1e3
    print(f"{count} tensors ({args.kind}), mean of {args.calls} calls (median), host transport, "
          f"1 PE (the calls move {count} small tensors; differences are host costs):")
    print(f"  execute_reshard_plan, same dicts:    {execute:.3f} ms ({execute_median:.3f}), of it "
          f"{collector:.3f} ms in the garbage collector, {check_median:.3f} ms (median) checking: "
          f"{per_tensor_us:.3f} us a tensor over the rerun")
    print(f"  the same-dicts check alone (one pass over src and dst): {check_ns:.1f} ns an array "
          f"(median of 200 passes; fastest {check_fastest_ns:.1f} ns)")
    print(f"  execute_reshard_plan, new dicts:     {rebuilt:.3f} ms ({rebuilt_median:.3f}): "
          f"{(rebuilt - rerun) / count * 1e3:.3f} us a tensor over the rerun")
    print(f"  rerun_reshard_plan:                  {rerun:.3f} ms ({rerun_median:.3f})")
    print(f"  bind() once, run():                  {bound:.3f} ms ({bound_median:.3f}): "
          f"{(bound - rerun) * 1e3:+.1f} us over the rerun")
    print(f"  update() of {len(few)} unchanged tensors: {update:.3f} ms ({update_median:.3f}): "
          f"{update / max(1, len(few)) * 1e3:.2f} us a tensor, its collective included")
    service.finalize()
    record(args, {"tensors": count, "execute_ms": execute, "execute_median_ms": execute_median,
                  "collector_ms": collector, "check_median_ms": check_median,
                  "rerun_ms": rerun, "rerun_median_ms": rerun_median,
                  "per_tensor_us": per_tensor_us, "new_dicts_ms": rebuilt,
                  "same_dicts_check_ns": check_ns,
                  "same_dicts_check_fastest_ns": check_fastest_ns,
                  "bound_run_ms": bound, "bound_run_median_ms": bound_median,
                  "update_tensors": len(few), "update_ms": update})


def megatron_refits(args):
    import torch
    from reshard.megatron import ReshardCopyService

    service = ReshardCopyService(transport="host")
    count = args.layers * (args.experts * 3 + 4)  # about the toy MoE's tensor count
    sent = [torch.randn(64, 64).to(torch.bfloat16) for _ in range(count)]
    received = [torch.zeros(64, 64, dtype=torch.bfloat16) for _ in range(count)]

    # --fresh: as Megatron's refit hands them over, new tensors every refit (a .contiguous()
    # copy of each slice sent, a new buffer for each received), made before the refit is timed.
    # (Two sets taken in turn after the first refit's: none of them the set registered.)
    batches = [(sent, received)]
    if args.fresh:
        batches += [([a.clone() for a in sent], [torch.empty_like(b) for b in received])
                    for _ in range(2)]
    turns = itertools.chain(batches[:1], itertools.cycle(batches[1:] or batches))

    def refit():
        a_list, b_list = next(turns)
        for task, (a, b) in enumerate(zip(a_list, b_list)):
            service.submit_send(a, 0, task_id=task)
            service.submit_recv(b, 0, task_id=task)
        service.run()

    refit()  # schedules
    mean, median, collector = timed_ms(refit, args.calls)
    if not all(torch.equal(a, b) for a_list, b_list in batches for a, b in zip(a_list, b_list)):
        raise SystemExit("a tensor arrived wrong")
    what = "new tensors every refit" if args.fresh else "the same tensors every refit"
    print(f"{count} tensors through ReshardCopyService ({what}), mean of {args.calls} refits "
          f"(median): {mean:.2f} ms ({median:.2f}), of it {collector:.2f} ms in the garbage "
          f"collector: {mean / count * 1e3:.2f} us a tensor")
    service.close()
    record(args, {"api": "megatron", "fresh": args.fresh, "tensors": count, "refit_ms": mean,
                  "refit_median_ms": median, "collector_ms": collector,
                  "per_tensor_us": mean / count * 1e3})


def record(args, fields):
    if not args.json:
        return
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                           capture_output=True, text=True).stdout.strip()
    line = {"bench": "python_call", "date": datetime.date.today().isoformat(), "commit": commit,
            "kind": args.kind, "calls": args.calls, **fields}
    with open(args.json, "a") as out:
        out.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
