"""One rank of Megatron-LM's own ``test_model_swap.py`` run with reshard's services
(``model_swap_harness.py``): every rank runs the same tests in the same order.

    python -m reshard.launch -n 4 tests/megatron/run_model_swap.py MEGATRON_TESTS_DIR [pytest args]

MEGATRON_TESTS_DIR is a folder holding Megatron's ``tests/unit_tests`` at one release tag (e.g.
``../shared/megatron-tests/core_v0.16.1``). Nothing is written there or in the working directory
(no bytecode, no pytest cache). Exits with pytest's status; rank 0 prints the summary.
"""

import os
import sys

sys.dont_write_bytecode = True


def main():
    tests = os.path.abspath(sys.argv[1])
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [tests, here]  # Megatron's `tests.unit_tests...` imports; the harness
    import pytest

    rank = int(os.environ.get("RANK", "0"))
    # Every rank's test outcomes go to the log (a rank failing alone shows), the summary once.
    args = [os.path.join(tests, "tests", "unit_tests", "resharding", "test_model_swap.py"),
            "-p", "model_swap_harness", "-p", "no:cacheprovider", "--noconftest",
            "--rootdir", tests, "-q", "-rA" if rank == 0 else "-rfE", "-p", "no:randomly",
            *sys.argv[2:]]
    return pytest.main(args)


if __name__ == "__main__":
    sys.exit(main())
