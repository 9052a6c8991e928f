"""One PE of a 2-PE job in which PE 1 arrives late, with a short transfer timeout (1 s) and a
longer arrival timeout (4 s):

1. PE 1 comes to schedule() 6 s late: both PEs' schedule() fail alike (PE 0's within the arrival
   timeout), naming PE 1 and saying nothing was scheduled; then both call schedule() again, which
   works, and run() moves every byte.
2. PE 1 comes to run() 2.5 s late, later than the transfer timeout but within the arrival
   timeout: the run succeeds.
3. PE 1 comes to run() 6 s late: PE 0 fails within the arrival timeout saying it waited for PE 1
   to begin run(), and that every PE is alive and the service usable; it runs again (with new
   values), and that run meets PE 1's, which began by meeting it: both move every byte, PE 0's
   new values, and the next run too.

Prints "rank R: ok" when its part held.

    late_arrival_worker.py
"""

import os
import sys
import time

import numpy as np

import reshard


def main():
    svc = reshard.CopyService("host", timeout=1, arrival_timeout=4).init("WARN")
    me = svc.my_pe
    src, dst = np.arange(64, dtype=np.uint8) + 100 * me, np.zeros(64, np.uint8)
    svc.register_send(1 + me, src, 0, 64, 1 - me)  # task 1: PE 0 to PE 1; task 2: back
    svc.register_receive(2 - me, dst, 0, 64, 1 - me)

    if me == 1:
        time.sleep(6)  # PE 0 gave up at 4 s and waits again in its second schedule()
    started = time.monotonic()
    try:
        svc.schedule()
        raise AssertionError("schedule() finished without PE 1")
    except reshard.ReshardError as error:
        waited, text = time.monotonic() - started, str(error)
        assert error.code == "timeout", (error.code, text)
        assert error.retryable, text
        for words in ("every PE must call schedule()", "arrival timeout",
                      "PE 1 did not call schedule() in time",
                      "nothing took effect", "call schedule() again on every PE"):
            assert words in text, (words, text)
        if me == 0:
            assert 3.5 < waited < 7.5, f"waited {waited:.1f} s for a 4 s arrival timeout"
    svc.schedule()
    svc.run()
    np.testing.assert_array_equal(dst, np.arange(64, dtype=np.uint8) + 100 * (1 - me))

    dst[:] = 0
    if me == 1:
        time.sleep(2.5)
    svc.run()  # later than the 1 s transfer timeout, within the 4 s arrival timeout
    np.testing.assert_array_equal(dst, np.arange(64, dtype=np.uint8) + 100 * (1 - me))

    if me == 1:
        time.sleep(6)
    started = time.monotonic()
    if me == 0:
        try:
            svc.run()
            raise AssertionError("run() finished without PE 1")
        except reshard.ReshardError as error:
            waited, text = time.monotonic() - started, str(error)
            assert error.code == "timeout", (error.code, text)
            assert isinstance(error, TimeoutError), type(error)
            assert error.retryable, text
            for words in ("waited 4", "for PE 1 to begin run() 3", "RESHARD_ARRIVAL_TIMEOUT_S",
                          "the service is usable: run again on every PE"):
                assert words in text, (words, text)
            assert waited < 7.5, f"waited {waited:.1f} s for a 4 s arrival timeout"
        src[:] = np.arange(64, dtype=np.uint8)[::-1]
    # PE 1 gets PE 0's new values; PE 0 PE 1's, as before.
    expected = np.arange(64, dtype=np.uint8)[::-1] if me == 1 else np.arange(64, dtype=np.uint8) + 100
    for _ in range(2):
        dst[:] = 0
        svc.run()  # the first: PE 0 runs again, PE 1's late run meets PE 0's retry first
        np.testing.assert_array_equal(dst, expected)
    print(f"rank {me}: ok")
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
