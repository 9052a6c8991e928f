"""Runs a Python script as N local processes, the way torchrun would, without torchrun.

    python -m reshard.launch -n 4 script.py [args...]

Each process gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT, and
each line it prints is prefixed with ``[rank N]`` (as ``reshard-run`` does). When one process fails
the others are stopped (SIGTERM, then SIGKILL after a grace period) and the launcher names the
first rank that failed and exits with its status, so a broken job never hangs.
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import BinaryIO, List, Optional

__all__ = ["launch", "main"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _stop(processes: List[subprocess.Popen], grace_s: float) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _prefix_lines(source: BinaryIO, target: BinaryIO, prefix: bytes, lock: threading.Lock) -> None:
    for line in iter(source.readline, b""):
        with lock:
            target.write(prefix + line)
            target.flush()
    source.close()


def launch(command: List[str], nprocs: int, env: Optional[dict] = None,
           timeout_s: Optional[float] = None, grace_s: float = 5.0) -> int:
    """Starts ``command`` ``nprocs`` times with torchrun's variables; returns the job's status
    (0, or the status of the rank that failed first: a negative value is the signal that killed
    it)."""
    if nprocs < 1:
        raise ValueError(f"nprocs must be at least 1, got {nprocs}")
    base = dict(os.environ if env is None else env)
    base.update(WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(_free_port()))
    processes, threads = [], []
    exits: "queue.Queue[tuple]" = queue.Queue()  # (rank, status) in the order they ended
    lock = threading.Lock()
    for rank in range(nprocs):
        process_env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
        process = subprocess.Popen(command, env=process_env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE)
        processes.append(process)
        prefix = f"[rank {rank}] ".encode()
        for source, target in ((process.stdout, sys.stdout), (process.stderr, sys.stderr)):
            thread = threading.Thread(target=_prefix_lines, daemon=True,
                                      args=(source, getattr(target, "buffer", target), prefix,
                                            lock))
            thread.start()
            threads.append(thread)
        # A waiter per rank: the order of exits says which rank failed first (a poll of all
        # ranks would see the peers it took down fail in the same round, and name the lowest).
        threading.Thread(target=lambda r=rank, p=process: exits.put((r, p.wait())),
                         daemon=True).start()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    finished = 0
    status = 0
    try:
        while finished < nprocs:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                rank, code = exits.get(timeout=wait)
            except queue.Empty:
                print(f"reshard.launch: the job ran past {timeout_s} s; stopping it",
                      file=sys.stderr)
                _stop(processes, grace_s)
                status = 124
                break
            finished += 1
            if code != 0:
                print(f"reshard.launch: rank {rank} exited with status {code}; stopping the "
                      "others", file=sys.stderr)
                _stop(processes, grace_s)
                status = code
                break
    except KeyboardInterrupt:
        _stop(processes, grace_s)
        status = 130
    for thread in threads:
        thread.join(timeout=grace_s)
    return status


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reshard.launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--nprocs", type=_positive, required=True,
                        help="processes to start (at least 1)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="stop the job after this many seconds")
    parser.add_argument("-m", dest="module", default=None, help="run a module, as python -m")
    parser.add_argument("script", nargs="?", help="the Python script to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    options = parser.parse_args(argv)
    if options.module:
        command = [sys.executable, "-m", options.module]
        if options.script:
            command.append(options.script)
    elif options.script:
        command = [sys.executable, options.script]
    else:
        parser.error("name a script (or -m module) to run")
    status = launch(command + options.args, options.nprocs, timeout_s=options.timeout)
    return status if status >= 0 else 128 - status


if __name__ == "__main__":
    sys.exit(main())
