"""One rank of a job that binds refits with groups and runs them a part at a time, checking every
destination element: after a run of some groups, exactly their parameters hold the source's
values and every other destination still holds what it held (a sentinel), bitwise; a loop over
all groups writes what a whole run writes. Random layouts from a seed; with a cast transform
(conversions recorded per phase, groups of local conversions only) and a staging budget. Then the refusals: an unknown group, groups on a refit bound without them, groups that
differ between ranks (the same error on every rank). A staged refit with groups: stage and commit
a group at a time, each commit switching exactly its groups. Prints "rank R: ok" at the end.

    refit_groups_worker.py SEED [host|cuda]
"""

import random
import sys

import numpy as np

import reshard

SENTINEL = 0x7E57


def layer_group(name):
    """groups="layers" by its rule: the name up to its first all-digit dotted part, else
    "embeddings" for names with "embed", else "head"."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return "embeddings" if "embed" in name else "head"


def expect_refusal(call, error_type, needle):
    """`call` raises `error_type` whose message holds `needle`."""
    try:
        call()
    except error_type as error:
        assert needle in str(error), error
        return
    raise AssertionError(f"accepted where '{needle}' was expected")


def main():
    seed = int(sys.argv[1])
    transport = sys.argv[2] if len(sys.argv) > 2 else "host"
    svc = reshard.CopyService(transport).init("WARN")
    me, n = svc.my_pe, svc.n_pes
    rng = random.Random(seed)
    if transport == "cuda":
        import torch
        torch.cuda.set_device(svc.device)

    def layouts():
        options = [reshard.Parallelism(tp=n), reshard.Parallelism(dp=n),
                   reshard.Parallelism(replicas=n)]
        if n % 2 == 0:
            options += [reshard.Parallelism(tp=n // 2, replicas=2),
                        reshard.Parallelism(tp=2, dp=n // 2)]
        return rng.choice(options), rng.choice(options)

    def array(values):
        """Host memory, or a PyTorch CUDA tensor of the same bits on the CUDA transport."""
        if transport != "cuda":
            return values
        import torch
        if values.dtype == np.uint16:
            values = values.view(np.int16)
        return torch.from_numpy(values).cuda()

    def host(tensor):
        return tensor if isinstance(tensor, np.ndarray) else tensor.cpu().numpy()

    cases = [("plain", None, None), ("cast", None, "float32"),
             ("cast in phases", "256KiB", "float32")]
    for case, budget, cast in cases:
        model = reshard.toy_model(rng.randint(2, 4), 64)
        src_par, dst_par = layouts()
        plan = reshard.make_reshard_plan(reshard.build_layout(model, src_par),
                                         reshard.build_layout(model, dst_par))

        def whole(p, step):
            return ((np.arange(np.prod(p.shape), dtype=np.uint32) * 2654435761 >> 9) + step * 31
                    + len(p.name)).astype(np.uint16).reshape(p.shape) & 0x3FFF

        def fill(layout, p, step):
            local = np.zeros(layout.local_shape(me, p.name), np.uint16)
            for offset, extent, local_at in layout.pieces(me, p.name):
                local[tuple(slice(o, o + e) for o, e in zip(local_at, extent))] = \
                    whole(p, step)[tuple(slice(o, o + e) for o, e in zip(offset, extent))]
            return local

        src, dst = {}, {}
        for p in plan.params:
            if plan.src_layout.local_shape(me, p.name) is not None:
                src[p.name] = reshard.LocalTensor(array(fill(plan.src_layout, p, 1)),
                                                  dtype="bfloat16")
            shape = plan.dst_layout.local_shape(me, p.name)
            if shape is not None:
                if cast:  # bf16 bits into float32 destinations
                    dst[p.name] = array(np.zeros(shape, np.float32))
                else:
                    dst[p.name] = reshard.LocalTensor(array(np.zeros(shape, np.uint16)),
                                                      dtype="bfloat16")

        def dst_bits(name):
            value = dst[name]
            data = value.data if isinstance(value, reshard.LocalTensor) else value
            if cast:
                return (host(data).view(np.uint32) >> 16).astype(np.uint16)
            return host(data).view(np.uint16)

        def set_sentinel():
            for value in dst.values():
                data = value.data if isinstance(value, reshard.LocalTensor) else value
                if cast:
                    data[...] = float(np.array([SENTINEL << 16], np.uint32).view(np.float32)[0])
                else:
                    data[...] = SENTINEL

        transform = reshard.make_cast_transform("float32") if cast else None
        refit = reshard.bind(plan, src, dst, svc, transform, staging_budget=budget,
                             groups="layers")
        groups = refit.groups
        names = {p.name: p for p in plan.params}
        group_of = {p.name: layer_group(p.name) for p in plan.params}
        assert sorted(groups) == sorted(set(group_of.values())), (groups, group_of)

        def check(done, what):
            for name in dst:
                got = dst_bits(name)
                if group_of[name] in done:
                    want = fill(plan.dst_layout, names[name], 1)
                else:
                    want = np.full(got.shape, SENTINEL, np.uint16)
                assert np.array_equal(got, want), \
                    f"rank {me}, {case} ({src_par} -> {dst_par}), {what}: '{name}' differs"

        # Each group alone, in a random order; then random sets at once (patterns included).
        for group in rng.sample(groups, len(groups)):
            set_sentinel()
            refit.run(groups=[group])
            check({group}, f"a run of group {group} alone")
        for _ in range(3):
            chosen = set(rng.sample(groups, rng.randint(1, len(groups))))
            set_sentinel()
            refit.run(groups=sorted(chosen))
            check(chosen, f"a run of groups {sorted(chosen)}")
        set_sentinel()
        refit.run(groups="layers.*")
        check({g for g in groups if g.startswith("layers.")}, "a run of the pattern layers.*")
        # A layer-at-a-time loop writes what a whole run writes.
        set_sentinel()
        for group in groups:
            refit.run(groups=group)
        check(set(groups), "a loop over every group")
        set_sentinel()
        refit.run()
        check(set(groups), "a whole run")
        assert refit.report.phases >= len(groups), (refit.report.phases, groups)

        expect_refusal(lambda: refit.run(groups=["no.such.group"]), ValueError,
                       "'no.such.group' names no group")
        refit.close()

        # Staged, a group at a time: a stage writes no destination; a commit switches exactly
        # its groups; a group not staged is refused with nothing written.
        staged = reshard.bind(plan, src, dst, svc, transform, staging_budget=budget,
                              groups="layers", staged=True)
        assert staged.groups == groups, (staged.groups, groups)
        order = rng.sample(groups, len(groups))
        first, rest = order[0], order[1:]
        set_sentinel()
        staged.stage(groups=[first])
        check(set(), f"a stage of group {first}")
        assert staged.staged_groups == [first] and not staged.staged, staged.staged_groups
        if rest:
            expect_refusal(lambda: staged.commit(groups=rest[:1]), reshard.ReshardError,
                           "is not staged")
            check(set(), "a refused commit")
        staged.commit(groups=[first])
        check({first}, f"a commit of group {first}")
        assert staged.version == 1 and staged.staged_groups == [], staged.staged_groups
        staged.stage()
        assert staged.staged
        staged.commit(groups=rest)
        check(set(groups), "the rest committed after a whole stage")
        set_sentinel()
        staged.commit(groups=[first])  # still staged by the whole stage
        check({first}, f"group {first} committed last")
        expect_refusal(lambda: staged.commit(), reshard.ReshardError, "nothing is staged")
        assert staged.version == 3, staged.version
        staged.close()

    # Without groups: run(groups=) is refused, saying how to bind them.
    refit = reshard.bind(plan, src, dst, svc, transform)
    expect_refusal(lambda: refit.run(groups=["layers.0"]), ValueError, "bound without groups")
    refit.close()

    # Ranks that group differently: refused on every rank alike, before anything is scheduled.
    expect_refusal(lambda: reshard.bind(plan, src, dst, svc, transform,
                                        groups="layers" if me else (lambda name: "one")),
                   reshard.ReshardError, "groups (ReshardOptions::param_groups) differ between PE")
    # The service stays usable: a corrected bind works.
    refit = reshard.bind(plan, src, dst, svc, transform, groups=lambda name: name)
    assert refit.groups == [p.name for p in plan.params]
    set_sentinel()
    refit.run(groups=[plan.params[-1].name])
    check_names = {plan.params[-1].name}
    for name in dst:
        got = dst_bits(name)
        want = (fill(plan.dst_layout, names[name], 1) if name in check_names else
                np.full(got.shape, SENTINEL, np.uint16))
        assert np.array_equal(got, want), f"rank {me}, one parameter's group: '{name}' differs"
    refit.close()
    svc.finalize()
    print(f"rank {me}: ok", flush=True)


if __name__ == "__main__":
    main()
