#!/usr/bin/env python3
"""Charts of reshard's benchmark results (the JSON lines under results/).

    python3 tools/bench/plot_results.py results/*.jsonl --out docs/img
    reshard bench plot results/*.jsonl --out docs/img      (the same, from the CLI)

Draws, from the newest run of each engine (files are appended to, so later lines are newer):

* ``all_to_all_<device>.png`` — per-GPU GB/s against per-peer size for every engine (SM, copy
  engine, auto, NVSHMEM, NCCL), with the copy-engine ceiling of one peer;
* ``all_to_all_ratio_<device>.png`` — each engine's rate divided by the rate of the NCCL run
  measured in the same run as it;
* ``refit_<device>.png`` — refit time per model, transform and transport/engine on each one's newest
  date's records, with the busiest PE's rate as a fraction of the copy-engine ceiling where the
  run measured it;
* ``colocated_<device>.png`` — PEs sharing one GPU (records with ``colocated`` / ``pes_per_gpu``;
  ``colocated_<n>x-<device>.png`` where they shared each of n GPUs):
  refit time of reshard, of the hand-written IPC copy loop and of one process copying the same
  bytes, per model, PEs per GPU and MPS off/on; and the 4 KiB all-to-all time;
* ``convert_<device>.png`` — ``reshard bench-convert``: each conversion's rate as a fraction of the
  device copy of the same bytes, per tensor set and layout, from the newest commit's records;
* ``copy_<transport>_<pes>pes.png`` — ``reshard bench`` (the host transport on a CPU machine): GB/s
  per PE of each workload beside one ``memcpy`` of the same bytes on every PE.

Needs matplotlib (``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Dict, Iterable, List

__all__ = ["load", "plot_all", "main"]


def load(paths: Iterable[Path]) -> List[dict]:
    records = []
    for path in paths:
        for number, line in enumerate(Path(path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise SystemExit(f"{path}:{number}: not JSON ({error})")
            record["_file"] = str(path)
            records.append(record)
    return records


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")


def _save(plt, figure, path: Path) -> None:
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _size_chart(plt, series, divisor, ylabel, title, path, reference=None) -> Path:
    """One line per series against the per-peer size (log scale), each point divided by
    `divisor(name, size)` (points it has no divisor for are left out)."""
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for name, points in sorted(series.items()):
        sizes = sorted(s for s in points if divisor(name, s))
        axis.plot(sizes, [points[s] / divisor(name, s) for s in sizes],
                  "k--" if "ceiling" in name else "o-", label=name)
    if reference is not None:
        axis.axhline(reference, color="grey", linewidth=1)
    axis.set_xscale("log", base=2)
    axis.set_xlabel("bytes per peer")
    axis.set_ylabel(ylabel)
    axis.set_title(title)
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()
    _save(plt, figure, path)
    return path


def plot_all_to_all(records: List[dict], out: Path, plt) -> List[Path]:
    written = []
    by_device = defaultdict(list)
    for record in records:
        if record.get("bench") in ("all_to_all", "ce_ceiling_one_peer") and \
                "pes_per_gpu" not in record:
            by_device[f"{record.get('gpus', '?')}x {record.get('device', 'GPU')}"].append(record)
    for device, rows in by_device.items():
        # Each engine's newest run (by commit), and every run's points, so an engine is compared
        # with the NCCL and ceiling measured beside it.
        newest, runs = {}, defaultdict(lambda: defaultdict(dict))
        for r in rows:
            name = r.get("engine", "copy-engine ceiling (1 peer)")
            newest[name] = r.get("commit", "")
            runs[r.get("commit", "")][name][r["per_peer_bytes"]] = r.get("gbps_per_gpu", r.get("gbps"))
        series = {name: runs[commit][name] for name, commit in newest.items()}
        dates = sorted({r.get("date", "") for r in rows if r.get("commit", "") in newest.values()})
        title = f"all-to-all, {device} ({', '.join(d for d in dates if d)})"
        written.append(_size_chart(plt, series, lambda name, size: 1.0, "GB/s per GPU (egress)",
                                   title, out / f"all_to_all_{_slug(device)}.png"))
        others = {n: p for n, p in series.items() if n != "nccl" and "ceiling" not in n}
        if others and "nccl" in series:
            def beside(name, size):
                return runs[newest[name]].get("nccl", {}).get(size)
            written.append(_size_chart(plt, others, beside, "rate / NCCL's rate (same run)",
                                       f"all-to-all vs NCCL, {device}",
                                       out / f"all_to_all_ratio_{_slug(device)}.png", 1.0))
    return written


def _newest_day(records: List[dict], key) -> Dict[tuple, str]:
    """The newest date among ``records`` of each ``key(record)``."""
    newest: Dict[tuple, str] = {}
    for r in records:
        newest[key(r)] = max(newest.get(key(r), ""), r.get("date", ""))
    return newest


def latest_refits(records: List[dict]) -> dict:
    """The refit chart's bars: (model, transform, transport) -> record, from each workload's
    (model and transform) newest day of records (the last of each key wins), with each run's
    baseline (timed on the same tensors in the same run) as a bar of its own. A day that measured
    one workload leaves the others' bars as their own newest day had them; workloads last
    measured more than a day before the newest record are left out (their figures stay in
    docs/performance.md's tables), so the chart shows one machine session's set."""
    refits = [r for r in records if r.get("bench") == "refit" and not r.get("colocated")
              and not (r["transport"] == "cuda" and "engine" not in r)]  # early: engine unsaid
    if not refits:
        return {}

    def workload(r: dict) -> tuple:
        return r["model"] + (f", {r['layers']} layers" if r.get("layers") else ""), r["transform"]

    newest = _newest_day(refits, workload)

    def day(date: str) -> int:
        try:
            return datetime.date.fromisoformat(date).toordinal()
        except ValueError:
            return 0

    last_day = max(day(date) for date in newest.values())
    latest = {}
    for r in refits:
        model, transform = workload(r)
        date = r.get("date", "")
        if date != newest[(model, transform)] or day(date) < last_day - 1:
            continue
        transport = r["transport"] + (f" ({r['engine']})" if r["transport"] == "cuda" else "")
        latest[(model, transform, transport)] = r
        if r.get("baseline") not in (None, "none") and r.get("baseline_median_s"):
            latest[(model, transform, f"{r['baseline']} (same run)")] = {
                "median_s": r["baseline_median_s"], "date": date}
    return latest


def plot_refits(records: List[dict], out: Path, plt) -> List[Path]:
    latest = latest_refits(records)
    if not latest:
        return []
    measured = [r for r in latest.values() if "pes" in r]
    newest_date = max(r.get("date", "") for r in measured)
    workloads = sorted({(m, t) for m, t, _ in latest})
    transports = sorted({k[2] for k in latest})
    figure, axis = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / max(1, len(transports))
    for i, transport in enumerate(transports):
        xs, heights, labels = [], [], []
        for j, workload in enumerate(workloads):
            r = latest.get((*workload, transport))
            if r is None:
                continue
            xs.append(j + i * width)
            heights.append(r["median_s"] * 1e3)
            ceiling = r.get("ce_ceiling_gbps")
            labels.append(f"{r['busiest_pe_gbps'] / ceiling:.2f}x" if ceiling else "")
        bars = axis.bar(xs, heights, width, label=transport)
        for bar, label in zip(bars, labels):
            if label:
                axis.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                              ha="center", va="bottom", fontsize=7)
    axis.set_xticks([j + width * (len(transports) - 1) / 2 for j in range(len(workloads))])
    axis.set_xticklabels([f"{m}\n{t}" for m, t in workloads], fontsize=8)
    axis.set_ylabel("ms per refit (lower is better)")
    device = f"{measured[-1].get('pes', '?')}x {measured[-1].get('device', 'GPUs')}"
    axis.set_title(f"refit through execute_reshard_plan, {device}, up to {newest_date}\n"
                   "(labels: busiest PE / copy-engine ceiling)")
    axis.legend(fontsize=8)
    axis.grid(True, axis="y", alpha=0.3)
    path = out / f"refit_{_slug(device)}.png"
    _save(plt, figure, path)
    return [path]


def _gpus_of(r: dict) -> int:
    """How many GPUs a run's PEs shared (one where a record does not say)."""
    pes = r.get("pes", r.get("gpus", 1))  # all-to-all records name their PE count "gpus"
    return max(1, pes // r["pes_per_gpu"]) if r.get("pes_per_gpu") else 1


def plot_colocated(records: List[dict], out: Path, plt) -> List[Path]:
    # One chart per kind of GPU (as plot_convert) and number of them: records of an H100 and an
    # H200, or of one GPU and four, are not compared.
    by_machine: Dict[tuple, List[dict]] = defaultdict(list)
    for r in records:
        by_machine[(r.get("device", "GPU"), _gpus_of(r))].append(r)
    return [path for (device, gpus), rows in sorted(by_machine.items())
            for path in _plot_colocated_on(rows, device, gpus, out, plt)]


def _plot_colocated_on(records: List[dict], device: str, gpus: int, out: Path,
                       plt) -> List[Path]:
    # Plain bf16 refits of the CUDA transport in its own order (not NVSHMEM's, not declared
    # nodes), the last record of each model, PE count and MPS setting (the files are appended to).
    refits = [r for r in records
              if r.get("bench") == "refit" and r.get("colocated")
              and r.get("transform", "none") == "none" and r.get("transport") == "cuda"
              and "node_size" not in r
              and r.get("same_device_order", "auto") in ("auto", "delegate")]
    if not refits:
        return []
    newest_date = max(r.get("date", "") for r in refits)
    latest = {}
    for r in refits:
        latest[(r["model"], r.get("layers"), r["pes"], r.get("mps", False))] = r
    keys = sorted(latest, key=lambda k: (k[0], k[3], k[2]))
    # 4 KiB all-to-alls: for each PE count and MPS setting, the fastest same-device order of its
    # newest day (records before 2026-11-24 name the PE count "pes", later ones "gpus").
    shared = [r for r in records
              if r.get("bench") == "all_to_all" and "pes_per_gpu" in r and "node_size" not in r
              and r.get("engine") == "sm" and r.get("per_peer_bytes") == 4096]
    def setting(r: dict) -> tuple:
        return r.get("pes", r.get("gpus")), r.get("mps", False)

    newest_small = _newest_day(shared, setting)
    small: Dict[tuple, float] = {}
    for r in shared:
        key = setting(r)
        if r.get("date", "") == newest_small[key]:
            small[key] = min(small.get(key, float("inf")), r["seconds"] * 1e6)
    if small:
        figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5),
                                             gridspec_kw={"width_ratios": [3, 1]})
    else:
        figure, left = plt.subplots(figsize=(8.5, 4.5))
    # Reruns (rerun_reshard_plan) where the records have them.
    series = [("reshard", lambda r: r["median_s"]),
              ("reshard, rerun_reshard_plan", lambda r: r.get("rerun_median_s")),
              ("hand-written IPC copy loop", lambda r: r.get("baseline_median_s")),
              ("one process copying the same bytes", lambda r: r.get("copy_ceiling_s"))]
    series = [(name, value) for name, value in series
              if any(value(latest[k]) for k in keys)]
    width = 0.8 / len(series)
    for i, (name, value) in enumerate(series):
        xs = [j + i * width for j, k in enumerate(keys) if value(latest[k])]
        heights = [value(latest[k]) * 1e3 for k in keys if value(latest[k])]
        left.bar(xs, heights, width, label=name)
    left.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(keys))])
    left.set_xticklabels([f"{m.split('-')[0]} {l}L\n{p} PEs, MPS {'on' if on else 'off'}"
                          for m, l, p, on in keys], fontsize=7)
    left.set_ylabel("ms per refit (lower is better)")
    where = f"one {device}" if gpus == 1 else f"each of {gpus} {device}s"
    left.set_title(f"colocated bf16 refits (the newest of each), PEs sharing {where}, "
                   f"up to {newest_date}", fontsize=9)
    left.legend(fontsize=7)
    left.grid(True, axis="y", alpha=0.3)
    if small:
        labels = sorted(small, key=lambda k: (k[1], k[0]))
        right.bar(range(len(labels)), [small[k] for k in labels], color="tab:blue")
        right.set_xticks(range(len(labels)))
        right.set_xticklabels([f"{p} PEs\nMPS {'on' if on else 'off'}" for p, on in labels],
                              fontsize=7)
        right.set_yscale("log")
        right.set_ylabel("us per 4 KiB all-to-all")
        right.set_title("small all-to-all", fontsize=9)
        right.grid(True, axis="y", alpha=0.3)
    path = out / f"colocated_{_slug(device) if gpus == 1 else f'{gpus}x-' + _slug(device)}.png"
    _save(plt, figure, path)
    return [path]


def plot_convert(records: List[dict], out: Path, plt) -> List[Path]:
    by_device: Dict[str, List[dict]] = defaultdict(list)
    for r in records:
        if r.get("bench") == "convert":
            by_device[r.get("device", "GPU")].append(r)
    written = []
    for device, rows in sorted(by_device.items()):
        # Files are appended to: each case's last record is its newest (a run that timed only
        # some conversions leaves the others' as they were).
        latest = {}
        for r in rows:
            latest[(r["tensors"], r["layout"], r["conversion"])] = r
        commits = ", ".join(dict.fromkeys(r.get("commit", "?") for r in latest.values()))
        cases = list(dict.fromkeys((t, layout) for t, layout, _ in latest))
        conversions = list(dict.fromkeys(c for _, _, c in latest))
        figure, axis = plt.subplots(figsize=(max(8, 1.3 * len(cases)), 4.5))
        width = 0.8 / max(1, len(conversions))
        for i, conversion in enumerate(conversions):
            xs, heights = [], []
            for j, case in enumerate(cases):
                r = latest.get((*case, conversion))
                if r is not None:
                    xs.append(j + i * width)
                    heights.append(r["fraction_of_copy"])
            axis.bar(xs, heights, width, label=conversion)
        axis.axhline(0.85, color="grey", linewidth=1, linestyle="--")
        axis.set_xticks([j + width * (len(conversions) - 1) / 2 for j in range(len(cases))])
        axis.set_xticklabels([f"{t.replace(' (', chr(10) + '(')}\n{layout}" for t, layout in cases],
                             fontsize=7)
        axis.set_ylabel("fraction of the device copy rate")
        date = rows[-1].get("date", "")
        axis.set_title(f"conversion kernels, {device}, up to {date}, commits {commits}", fontsize=9)
        axis.legend(fontsize=7, ncol=4)
        axis.grid(True, axis="y", alpha=0.3)
        path = out / f"convert_{_slug(device)}.png"
        _save(plt, figure, path)
        written.append(path)
    return written


def _is_copy_record(r: dict) -> bool:
    # `reshard bench` records; the early ones did not name their benchmark.
    return r.get("bench") == "copy" or ("bench" not in r and "seconds_per_run" in r)


def plot_copy(records: List[dict], out: Path, plt) -> List[Path]:
    runs: Dict[tuple, Dict[str, dict]] = defaultdict(dict)
    for r in records:
        if _is_copy_record(r):
            runs[(r.get("transport", "host"), r.get("pes", 0))][r["workload"]] = r  # last wins
    written = []
    for (transport, pes), rows in sorted(runs.items()):
        workloads = list(rows)
        figure, axis = plt.subplots(figsize=(7, 4.5))
        xs = range(len(workloads))
        rate = [rows[w]["bound_bytes"] / rows[w]["seconds_per_run"] / 1e9 for w in workloads]
        copy = [rows[w]["bound_bytes"] / rows[w]["memcpy_seconds"] / 1e9 for w in workloads]
        axis.bar([x - 0.2 for x in xs], rate, 0.4, label=f"reshard ({transport})")
        axis.bar([x + 0.2 for x in xs], copy, 0.4, label="memcpy of the same bytes")
        axis.set_xticks(list(xs))
        axis.set_xticklabels(workloads)
        axis.set_ylabel("GB/s per PE (busiest PE's bytes over the time)")
        date = max(rows[w].get("date", "") for w in workloads)
        axis.set_title(f"reshard bench, {transport} transport, {pes} PEs, {date[:10]}")
        axis.legend()
        axis.grid(True, axis="y", alpha=0.3)
        path = out / f"copy_{_slug(transport)}_{pes}pes.png"
        _save(plt, figure, path)
        written.append(path)
    return written


def plot_all(records: List[dict], out: Path) -> List[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("plotting needs matplotlib: pip install matplotlib")
    out.mkdir(parents=True, exist_ok=True)
    return (plot_all_to_all(records, out, plt) + plot_refits(records, out, plt) +
            plot_colocated(records, out, plt) + plot_convert(records, out, plt) +
            plot_copy(records, out, plt))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="plot_results.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path, help="JSON-lines result files")
    parser.add_argument("--out", type=Path, required=True, help="directory for the PNG files")
    options = parser.parse_args(argv)
    written = plot_all(load(options.results), options.out)
    for path in written:
        print(path)
    if not written:
        print("no benchmark records to plot", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
