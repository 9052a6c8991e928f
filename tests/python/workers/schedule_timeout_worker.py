"""One PE of a 2-PE job in which PE 1 does not call schedule(): PE 0's schedule() must fail
within the service's own timeout (CopyService(timeout=3), shorter than RESHARD_TIMEOUT_S), saying
that every PE must call schedule() and naming PE 1. Prints "rank R: ok".

    schedule_timeout_worker.py
"""

import os
import sys
import time

import numpy as np

import reshard


def main():
    svc = reshard.CopyService("host", timeout=3).init("WARN")
    me = svc.my_pe
    src, dst = np.arange(64, dtype=np.uint8), np.zeros(64, np.uint8)
    svc.register_send(1, src, 0, 64, 1 - me)
    svc.register_receive(1, dst, 0, 64, 1 - me)
    if me == 1:
        time.sleep(12)  # never schedules; leaves after PE 0 has given up
        print(f"rank {me}: ok")
        sys.stdout.flush()
        os._exit(0)
    started = time.monotonic()
    try:
        svc.schedule()
        raise AssertionError("schedule() finished without PE 1")
    except reshard.ReshardError as error:
        waited = time.monotonic() - started
        text = str(error)
        assert error.code == "timeout", (error.code, text)
        assert "every PE must call schedule()" in text and "rank(s) 1" in text, text
        assert waited < 9, f"waited {waited:.1f} s for a 3 s timeout"
    print(f"rank {me}: ok")
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
