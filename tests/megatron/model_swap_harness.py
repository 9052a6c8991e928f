"""A pytest plugin that runs Megatron-LM's own ``tests/unit_tests/resharding/test_model_swap.py``
(its test bodies unchanged) with reshard's copy services among its refit backends, on the CPU.

Loaded on every rank of a job (``run_model_swap.py``): each rank runs the same tests in the same
order, as Megatron's own tests run under torchrun. What it provides, where the machine has no GPU:

- CUDA calls of the tests and their utilities on a CPU-only PyTorch (``set_device``,
  ``synchronize``, streams, ``device_count`` 1) and ``device="cuda..."`` in the test module mapped
  to the CPU; ``torch.distributed`` on Gloo (the tests' helper asks for NCCL), with each group
  made by every rank (Gloo connects a group when it is made); Megatron's local
  layer spec where Transformer Engine is absent; Megatron's own inference RNG tracker (its CUDA
  RNG tracker needs a GPU; the tests' dropouts are 0).
- ``refit_backend`` takes ``gloo`` (Megatron's own service, the reference), ``reshard``
  (``reshard.megatron.ReshardCopyService()``), ``nvshmem`` (Megatron's own ``NVSHMEMCopyService``
  with reshard's ``RemoteCopyService`` in place of Megatron's, as a user swaps it in by changing
  the import) and ``moves-nothing``, a control service that moves no byte: that test must fail
  (strict xfail), or the harness would not catch wrong weights. ``nccl`` needs GPUs.

Options: ``--refit-backends gloo,reshard,nvshmem,moves-nothing`` narrows the backends.
"""

import contextlib
import functools
import os
import sys
import types

import pytest
import torch
import torch.distributed as dist

CPU = not torch.cuda.is_available()
BACKENDS = ["gloo", "reshard", "nvshmem", "moves-nothing"]


def pytest_addoption(parser):
    parser.addoption("--refit-backends", default=",".join(BACKENDS),
                     help="refit_backend values to run: " + ", ".join(BACKENDS) + ", nccl")


class _NoStream:
    """What the CPU has of a CUDA stream: nothing to wait for."""

    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass


def _cpu_shims():
    """CUDA calls of the tests, their utilities and Megatron's services on a CPU-only PyTorch."""
    torch.cuda.set_device = lambda *args, **kwargs: None
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: torch.device("cpu")  # where Megatron places tensors
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.memory.empty_cache = lambda: None
    torch.cuda.Stream = lambda *args, **kwargs: _NoStream()
    torch.cuda.current_stream = lambda *args, **kwargs: _NoStream()
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    init = dist.init_process_group

    @functools.wraps(init)
    def on_gloo(*args, backend=None, **kwargs):
        return init(*args[1:] if args else args, backend="gloo", **kwargs)

    dist.init_process_group = on_gloo
    _collective_new_group()


def _collective_new_group():
    """Gloo connects a group's members when the group is made, and every rank must make the same
    groups in the same order: where each rank asks for a group of its own (the tests' embedding
    groups, one rank each), every rank makes every rank's group instead."""
    new_group = dist.new_group

    @functools.wraps(new_group)
    def every_ranks_group(ranks=None, *args, **kwargs):
        mine = tuple(sorted(ranks)) if ranks is not None else None
        asked = [None] * dist.get_world_size()
        dist.all_gather_object(asked, mine)
        made = None
        for wanted in dict.fromkeys(asked):
            group = new_group(list(wanted) if wanted is not None else None, *args, **kwargs)
            if wanted == mine:
                made = group
        return made

    dist.new_group = every_ranks_group


def _substitute_remote_copy_service():
    """Megatron's NVSHMEMCopyService over reshard's RemoteCopyService: the one-line import a user
    changes, made in Megatron's module."""
    import reshard.megatron
    from megatron.core.resharding.copy_services import nvshmem_copy_service

    nvshmem_copy_service.RemoteCopyService = reshard.megatron.RemoteCopyService


def _stub_training_arguments():
    """Megatron's 0.19 test utilities import megatron.training, which megatron-core's wheel does
    not ship; test_model_swap.py uses none of it."""
    try:
        import megatron.training.argument_utils  # noqa: F401
    except ImportError:
        module = types.ModuleType("megatron.training.argument_utils")

        def unavailable(*args, **kwargs):
            raise RuntimeError("megatron.training is not installed (megatron-core only)")

        for name in ("gpt_config_from_args", "hybrid_config_from_args",
                     "pretrain_cfg_container_from_args"):
            setattr(module, name, unavailable)
        package = sys.modules.get("megatron.training") or types.ModuleType("megatron.training")
        package.argument_utils = module
        sys.modules.setdefault("megatron.training", package)
        sys.modules["megatron.training.argument_utils"] = module


def pytest_configure(config):
    if CPU:
        _cpu_shims()
    _stub_training_arguments()
    _substitute_remote_copy_service()


class _CpuTorch(types.ModuleType):
    """The test module's ``torch``, with CUDA devices mapped to the CPU."""

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def device(*args, **kwargs):
        spec = args[0] if args else kwargs.get("type")
        if isinstance(spec, str) and spec.startswith("cuda"):
            return torch.device("cpu")
        return torch.device(*args, **kwargs)


class MovesNothing:
    """A control copy service: takes every request and moves no byte."""

    def submit_send(self, *args, **kwargs):
        pass

    def submit_recv(self, *args, **kwargs):
        pass

    def run(self):
        pass


_services = {}


def _service(name):
    """One service per backend and process, as Megatron caches its own."""
    if name not in _services:
        if name == "reshard":
            from reshard.megatron import ReshardCopyService
            _services[name] = ReshardCopyService()
        else:
            from megatron.core.resharding.copy_services.base import CopyService

            _services[name] = type("MovesNothingCopyService", (MovesNothing, CopyService), {})()
    return _services[name]


def _patch_test_module(module):
    if getattr(module, "_reshard_harness", False):
        return
    module._reshard_harness = True
    swap = module.swap_model_weights

    @functools.wraps(swap)
    def swap_model_weights(src, dst, refit_method, *args, **kwargs):
        if refit_method in ("reshard", "moves-nothing"):
            refit_method = _service(refit_method)
        return swap(src, dst, refit_method, *args, **kwargs)

    module.swap_model_weights = swap_model_weights
    if CPU:
        module.torch = _CpuTorch()
        seed = module.model_parallel_cuda_manual_seed
        module.model_parallel_cuda_manual_seed = functools.partial(
            seed, inference_rng_tracker=True, force_reset_rng=True)
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        module.get_gpt_layer_with_transformer_engine_spec = module.get_gpt_layer_local_spec


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc):
    if "refit_backend" not in metafunc.fixturenames:
        return
    _patch_test_module(metafunc.module)
    wanted = metafunc.config.getoption("--refit-backends").split(",")
    values = []
    for name in wanted:
        marks = []
        if name == "moves-nothing":
            marks.append(pytest.mark.xfail(strict=True, reason="the control moves no byte: "
                                           "Megatron's comparison must catch it"))
        if name == "nccl" and CPU:
            marks.append(pytest.mark.skip(reason="NCCL needs GPUs"))
        values.append(pytest.param(name, marks=marks, id=name))
    markers = metafunc.definition.own_markers
    for i, mark in enumerate(markers):
        if mark.name == "parametrize" and mark.args and mark.args[0] == "refit_backend":
            markers[i] = pytest.mark.parametrize("refit_backend", values).mark


def pytest_runtest_logreport(report):
    """Each test's outcome on every rank as it ends, one line (a job of ranks shows where it is)."""
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        outcome = "XFAIL" if hasattr(report, "wasxfail") and report.outcome == "skipped" \
            else report.outcome.upper()
        print(f"\n{outcome} {report.nodeid.rsplit('::', 1)[-1]} ({report.duration:.1f} s)",
              file=sys.__stderr__, flush=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The process groups a test made (its HyperCommGrid's and embedding groups, which Megatron's
    Utils.destroy_model_parallel leaves, and its services') are destroyed after it: Gloo keeps
    threads and sockets for each, and a job of dozens of tests would slow down test by test."""
    world = dist.distributed_c10d._world
    before = set(world.pg_map) if dist.is_initialized() else set()
    yield
    # Megatron keeps the services made from backend names (which hold groups) for later calls:
    # finalized and dropped with the test's groups (its clear_service_cache is for this).
    from megatron.core.resharding import refit

    for service in list(getattr(refit, "_service_cache", {}).values()):
        remote = getattr(service, "_remote", None)
        if remote is not None and hasattr(remote, "finalize"):
            remote.finalize()
    refit.clear_service_cache()
    if dist.is_initialized():
        for group in [g for g in list(world.pg_map) if g not in before]:
            if group is not dist.GroupMember.WORLD:
                dist.destroy_process_group(group)
