"""One rank of a GPU job for the bound refit (reshard.bind), TP n -> n replicas of a toy model:

* writes queued on a non-default *current* PyTorch stream right before a refit (behind a long
  kernel) are read by run() and by execute_reshard_plan given no stream;
* a refit with MXFP8 quantized on arrival, captured in a CUDA graph (torch.cuda.graph) and
  replayed, writes bit for bit what the refit run directly writes, at every replay with new
  source values;
* the same refit captured by reshard itself (BoundRefit.capture_graph) and replayed with one
  launch: bit for bit again, its host time beside torch's replay of its own capture, and a
  replay after an update() that scheduled the refit again refused.

    bound_refit_gpu_worker.py
Prints "rank R: ok" at the end, the failures otherwise.
"""

import ctypes
import os
import statistics
import sys
import time

import torch

import reshard

SLEEP_CYCLES = 200_000_000  # about 0.1 s of GPU time: far longer than a refit takes to start


def graph_nodes(graph) -> str:
    """How many nodes the captured graph has (the driver's count), or '?' where this torch keeps
    no graph handle after instantiating it."""
    try:
        count = ctypes.c_size_t(0)
        handle = ctypes.c_void_p(graph.raw_cuda_graph())
        if ctypes.CDLL("libcuda.so.1").cuGraphGetNodes(handle, None, ctypes.byref(count)) == 0:
            return str(count.value)
    except Exception:  # noqa: BLE001 - a count for the log only
        pass
    return "?"


def main():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    svc = reshard.CopyService("cuda").init("WARN")
    me, n = svc.my_pe, svc.n_pes
    failures = []
    model = reshard.toy_model(2, 256)
    plan = reshard.make_reshard_plan(
        reshard.build_layout(model, reshard.Parallelism(tp=n)),
        reshard.build_layout(model, reshard.Parallelism(tp=1, replicas=n)))

    def sources_of(full):
        out = {}
        for name, tensor in full.items():
            shape = plan.src_layout.local_shape(me, name)
            if shape is None:
                continue
            local = torch.zeros(tuple(shape), dtype=torch.bfloat16)
            for offset, extent, local_at in plan.src_layout.pieces(me, name):
                at = tuple(slice(a, a + e) for a, e in zip(local_at, extent))
                local[at] = tensor[tuple(slice(o, o + e) for o, e in zip(offset, extent))]
            out[name] = local.cuda()
        return out

    def weights(seed):
        generator = torch.Generator().manual_seed(seed)
        return {p.name: torch.randn(tuple(p.shape), generator=generator).to(torch.bfloat16)
                for p in plan.params}

    # 1. Writes on a side stream made current, behind a long kernel, right before the refit.
    sources = {name: torch.zeros_like(t) for name, t in sources_of(weights(0)).items()}
    destinations = {p.name: torch.zeros(tuple(plan.dst_layout.local_shape(me, p.name)),
                                        dtype=torch.bfloat16, device="cuda")
                    for p in plan.params if plan.dst_layout.local_shape(me, p.name) is not None}
    refit = reshard.bind(plan, sources, destinations, svc)
    side = torch.cuda.Stream()
    for trial, call in enumerate(("bound run()", "execute_reshard_plan", "bound run()")):
        full = weights(trial + 1)
        ready = sources_of(full)
        for tensor in destinations.values():
            tensor.zero_()
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)  # the current stream is busy ...
            for name, tensor in sources.items():
                tensor.copy_(ready[name])     # ... and the sources are written after it
            if call == "bound run()":
                refit.run()
            else:
                reshard.execute_reshard_plan(plan, sources, destinations, svc)
                refit = reshard.bind(plan, sources, destinations, svc)  # the service's schedule
        for name, tensor in destinations.items():
            if not torch.equal(tensor.cpu(), full[name]):
                failures.append(f"{call}, trial {trial}: '{name}' differs from the sources "
                                "written on the current (non-default) stream")
                break
    svc.clear_requests()
    del refit

    # 2. MXFP8 on arrival, captured in a CUDA graph and replayed.
    mx = reshard.make_mxfp8_transform(side="receiver")
    quantized = {p.name for p in plan.params if len(p.shape) >= 2}

    def fp8_destinations():
        out = {}
        for p in plan.params:
            shape = plan.dst_layout.local_shape(me, p.name)
            if shape is None:
                continue
            if p.name in quantized:
                scale = mx.destination_scale(tuple(shape))
                out[p.name] = reshard.LocalTensor(
                    torch.zeros(tuple(shape), dtype=torch.float8_e4m3fn, device="cuda"),
                    scale=torch.zeros(tuple(scale.shape), dtype=torch.uint8, device="cuda"),
                    dtype="float8_e4m3")
            else:
                out[p.name] = torch.zeros(tuple(shape), dtype=torch.bfloat16, device="cuda")
        return out

    def as_bytes(value):
        data = value.data if isinstance(value, reshard.LocalTensor) else value
        parts = [data.view(torch.uint8).cpu()]
        if isinstance(value, reshard.LocalTensor):
            parts.append(value.scale.cpu())
        return parts

    graphed_src = {name: torch.zeros_like(t) for name, t in sources_of(weights(0)).items()}
    graphed_dst = fp8_destinations()
    graphed = reshard.bind(plan, graphed_src, graphed_dst, svc, mx)
    stream = torch.cuda.Stream()
    # Warm-up outside the capture (as torch.cuda.graph wants), then capture one run.
    with torch.cuda.stream(stream):
        graphed.run(stream)
    stream.synchronize()
    svc.all_gather(b"")
    try:
        graph, kept = torch.cuda.CUDAGraph(keep_graph=True), True
    except TypeError:  # a torch without keep_graph
        graph, kept = torch.cuda.CUDAGraph(), False
    with torch.cuda.graph(graph, stream=stream):
        graphed.run(stream)
    if kept:
        graph.instantiate()
    svc.all_gather(b"")
    reference_svc = reshard.CopyService("cuda").init("WARN")

    def check_replays(replay_once, label, first_seed):
        """Three replays, each of new source values into cleared destinations, each compared
        bit for bit with the same refit executed directly on a service of its own."""
        for replay in range(3):
            full = weights(first_seed + replay)
            for name, tensor in sources_of(full).items():
                graphed_src[name].copy_(tensor)
            for value in graphed_dst.values():
                (value.data if isinstance(value, reshard.LocalTensor) else value).zero_()
            torch.cuda.synchronize()
            svc.all_gather(b"")
            started = time.perf_counter()
            replay_once()
            host = time.perf_counter() - started
            torch.cuda.synchronize()
            reference = fp8_destinations()
            reshard.execute_reshard_plan(plan, graphed_src, reference, reference_svc, mx)
            torch.cuda.synchronize()
            for name in reference:
                if any(not torch.equal(a, b) for a, b in
                       zip(as_bytes(graphed_dst[name]), as_bytes(reference[name]))):
                    failures.append(f"{label} {replay}: '{name}' differs from a direct refit")
                    break
            print(f"rank {me}: {label} {replay} host time {host * 1e6:.1f} us")

    check_replays(graph.replay, "graph replay", 10)
    # Host time of a replay once the graph is on the device (the first launch uploads it).
    hosts = []
    for _ in range(50):
        svc.all_gather(b"")
        started = time.perf_counter()
        graph.replay()
        hosts.append(time.perf_counter() - started)
        torch.cuda.synchronize()
    print(f"rank {me}: median host time of 50 replays {statistics.median(hosts) * 1e6:.1f} us, "
          f"{graph_nodes(graph)} nodes")

    # 3. reshard's own capture: RefitGraph.replay() is one launch from Python.
    native = graphed.capture_graph(stream)
    svc.all_gather(b"")
    check_replays(lambda: native.replay(stream), "RefitGraph replay", 20)
    handle = stream.cuda_stream
    spans = {"RefitGraph.replay": [], "torch graph.replay": []}
    for _ in range(50):
        for label, call in (("RefitGraph.replay", lambda: native.replay(handle)),
                            ("torch graph.replay", graph.replay)):
            svc.all_gather(b"")
            call()  # the launch path warm, as in an engine's step of many launches
            torch.cuda.synchronize()
            started = time.perf_counter()
            call()
            spans[label].append(time.perf_counter() - started)
            torch.cuda.synchronize()
    print(f"rank {me}: median host time right after a replay: " + ", ".join(
        f"{label} {statistics.median(s) * 1e6:.1f} us" for label, s in spans.items()))
    # A new destination tensor schedules the refit again: the graph would write into the old one.
    name = next(iter(graphed_dst))
    fresh = fp8_destinations()[name]
    graphed.update(dst={name: fresh})
    try:
        native.replay(stream)
        failures.append("a replay after an update() that scheduled again was not refused")
    except reshard.InvalidStateError as error:
        if "capture the refit again" not in str(error):
            failures.append(f"the refused replay does not say what to do: {error}")
    stream.synchronize()
    reference_svc.finalize()
    svc.finalize()
    for failure in failures[:10]:
        print(f"rank {me}: {failure}", file=sys.stderr)
    if not failures:
        print(f"rank {me}: ok")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
