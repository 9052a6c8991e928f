"""Runs a Python script as N local processes, the way torchrun would, without torchrun.

    python -m reshard.launch -n 4 script.py [args...]

Each process gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT. When
one process fails the others are stopped (SIGTERM, then SIGKILL after a grace period) and the
launcher exits with the failed process's status, so a broken job never hangs.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from typing import List, Optional

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


def launch(command: List[str], nprocs: int, env: Optional[dict] = None,
           timeout_s: Optional[float] = None, grace_s: float = 5.0) -> int:
    """Starts ``command`` ``nprocs`` times with torchrun's variables; returns the job's status
    (0, or the first failure's: a negative value is the signal that killed it)."""
    if nprocs < 1:
        raise ValueError(f"nprocs must be at least 1, got {nprocs}")
    base = dict(os.environ if env is None else env)
    base.update(WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(_free_port()))
    processes = []
    for rank in range(nprocs):
        process_env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
        processes.append(subprocess.Popen(command, env=process_env))
    start = time.monotonic()
    try:
        while True:
            statuses = [process.poll() for process in processes]
            failed = [(rank, s) for rank, s in enumerate(statuses) if s not in (None, 0)]
            if failed:
                rank, status = failed[0]
                print(f"reshard.launch: rank {rank} exited with status {status}; stopping the "
                      "others", file=sys.stderr)
                _stop(processes, grace_s)
                return status
            if all(s == 0 for s in statuses):
                return 0
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                print(f"reshard.launch: the job ran past {timeout_s} s; stopping it",
                      file=sys.stderr)
                _stop(processes, grace_s)
                return 124
            time.sleep(0.05)
    except KeyboardInterrupt:
        _stop(processes, grace_s)
        return 130


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reshard.launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--nprocs", type=int, required=True, help="processes to start")
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
