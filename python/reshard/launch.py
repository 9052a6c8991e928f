"""Runs a Python script as N local processes, the way torchrun would, without torchrun.

    python -m reshard.launch -n 4 script.py [args...]

Each process gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT, and
each line it prints is prefixed with ``[rank N]``. When one process fails the others are stopped
(SIGTERM, then SIGKILL after a grace period) and the launcher names the first rank that failed and
exits with its status, so a broken job never hangs; ``--timeout`` bounds the whole job. It is
``reshard-run``'s launcher, reached through the extension module.
"""

from __future__ import annotations

import argparse
import socket
import sys
from typing import List, Optional, Tuple

from . import _core
from .errors import refusal as _refusal

__all__ = ["launch", "main"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(command: List[str], nprocs: int, env: Optional[dict] = None,
           timeout_s: Optional[float] = None, grace_s: float = 5.0) -> int:
    """Starts ``command`` ``nprocs`` times with torchrun's variables; returns the job's status:
    0, or the status of the rank that failed first (128 + N for signal N, 124 past
    ``timeout_s``). The processes write to this process's standard output and error (its file
    descriptors 1 and 2), each line prefixed with its rank. This is the launcher ``reshard-run``
    uses, from the extension module; a command that cannot start raises ``ReshardError``."""
    if nprocs < 1:
        raise _refusal(f"nprocs must be at least 1, got {nprocs}")
    if timeout_s is not None and timeout_s <= 0:
        raise _refusal(f"timeout_s must be positive, got {timeout_s}")
    return _run(command, nprocs, env, timeout_s, grace_s)[0]


def _run(command: List[str], nprocs: int, env: Optional[dict], timeout_s: Optional[float],
         grace_s: float) -> Tuple[int, int, str]:
    """(status, first failed rank or -1, a line saying what failed)."""
    environment = None if env is None else [f"{name}={value}" for name, value in env.items()]
    for stream in (sys.stdout, sys.stderr):  # what Python printed comes before the job's lines
        stream.flush()
    return _core.launch_local([str(part) for part in command], nprocs,
                              timeout_s=timeout_s or 0.0, grace_s=grace_s,
                              environment=environment)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reshard.launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--nprocs", type=_positive, required=True,
                        help="processes to start (at least 1)")
    parser.add_argument("--timeout", type=_positive_seconds, default=None,
                        help="stop the job after this many seconds (exit status 124)")
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
    try:
        status, _, summary = _run(command + options.args, options.nprocs, None, options.timeout,
                                  grace_s=5.0)
    except _core.ReshardError as error:
        print(f"reshard.launch: {error}", file=sys.stderr)
        return 2
    if status != 0:
        print(f"reshard.launch: job failed: {summary}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
