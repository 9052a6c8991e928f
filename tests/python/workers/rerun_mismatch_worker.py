"""One rank of a job in which rank 0 reruns a refit while the others execute the plan with new
tensors: calls that do not match. Every rank must fail within the service's timeouts (rank 0 waits
for peers that never begin its run: the arrival timeout, set as short as the other), rank 0 naming
the calls that must match; each prints one line saying how its call ended.

    rerun_mismatch_worker.py TIMEOUT_SECONDS
"""

import sys
import time

import numpy as np

import reshard


def main():
    timeout = float(sys.argv[1])
    svc = reshard.CopyService("host", timeout=timeout, arrival_timeout=timeout).init("WARN")
    me, n = svc.my_pe, svc.n_pes
    model = reshard.toy_model(1, 64)
    # TP n -> n replicas: every rank needs the others' slices.
    plan = reshard.make_reshard_plan(reshard.build_layout(model, reshard.Parallelism(tp=n)),
                                     reshard.build_layout(model, reshard.Parallelism(dp=n)))

    def tensors(layout):
        return {p.name: reshard.LocalTensor(np.zeros(layout.local_shape(me, p.name), np.uint16),
                                            dtype="bfloat16")
                for p in plan.params if layout.local_shape(me, p.name) is not None}

    src, dst = tensors(plan.src_layout), tensors(plan.dst_layout)
    reshard.execute_reshard_plan(plan, src, dst, svc)
    began = time.monotonic()
    try:
        if me == 0:
            reshard.rerun_reshard_plan(plan, svc)
        else:
            reshard.execute_reshard_plan(plan, src, tensors(plan.dst_layout), svc)
        print(f"rank {me}: returned")
    except reshard.ReshardError as error:
        print(f"rank {me}: {error.code} after {time.monotonic() - began:.1f} s: {error}")
    svc.finalize()


if __name__ == "__main__":
    main()
