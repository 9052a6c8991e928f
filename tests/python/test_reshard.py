"""The Python package: the copy service, the planner and execute_reshard_plan through NumPy (and,
where present, PyTorch) tensors; multi-process jobs go through `python -m reshard.launch`. GPU
cases skip unless CUDA and enough GPUs are present."""

import datetime
import gc
import os
import re
import shutil
import subprocess
import sys
import time
import weakref
from pathlib import Path

import numpy as np
import pytest

import reshard

HERE = Path(__file__).resolve().parent
WORKERS = HERE / "workers"
ROOT = HERE.parent.parent
EXAMPLES = ROOT / "examples" / "python"


def gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


# The jobs' time limits guard against hangs only: no test may fail from a slow machine alone, so
# they stretch by RESHARD_TEST_TIME_SCALE (default 3; a loaded 2-core machine ran a 15 s job in 50).
TIME_SCALE = float(os.environ.get("RESHARD_TEST_TIME_SCALE", "3"))


def launch(n, script, *args, timeout=240, **extra_env):
    """Runs `script` as n processes through reshard.launch; returns the completed process.
    `timeout`: the job's limit on an idle machine (stretched by TIME_SCALE)."""
    env = dict(os.environ, **extra_env, PYTHONPATH=os.pathsep.join(filter(None, [
        str(Path(reshard.__file__).parent.parent), os.environ.get("PYTHONPATH")])))
    env.setdefault("RESHARD_TIMEOUT_S", "20")
    # A late or stopped PE fails the others within the test's limit, arriving or mid-transfer.
    env.setdefault("RESHARD_ARRIVAL_TIMEOUT_S", env["RESHARD_TIMEOUT_S"])
    limit = timeout * TIME_SCALE
    return subprocess.run([sys.executable, "-m", "reshard.launch", "-n", str(n), "--timeout",
                           str(limit - 10), str(script), *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=limit)


def assert_ok(result):
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"


# ---- one process ----

@pytest.mark.quick
def test_component_versions_name_this_build():
    versions = reshard.component_versions()
    assert versions.startswith("reshard " + reshard.__version__)
    for transport, component in (("nccl", "NCCL "), ("nvshmem", "NVSHMEM ")):
        assert (component in versions) == (transport in reshard.available_transports())


@pytest.mark.quick
def test_host_transport_is_always_available():
    assert "host" in reshard.available_transports()


@pytest.fixture
def service():
    svc = reshard.CopyService(transport="host").init("WARN")
    yield svc
    svc.finalize()


@pytest.mark.quick
def test_single_pe_copies_bytes_in_place(service):
    assert (service.my_pe, service.n_pes, service.initialized) == (0, 1, True)
    src = np.arange(100, dtype=np.float32)
    dst = np.zeros(100, dtype=np.float32)
    service.register_send(5, src, 40, 200, 0)
    service.register_receive(5, dst, 0, 200, 0)
    assert service.schedule().transfers == 1
    for shift in range(2):
        src += shift
        service.run()
        np.testing.assert_array_equal(dst[:50], src[10:60])
        assert not dst[50:].any()


def test_the_host_transport_waits_in_no_stream_said_by_a_deprecated_property(service):
    assert service.transport == "host"
    with pytest.warns(DeprecationWarning, match="waits_in_stream_front_end is deprecated"):
        assert not service.waits_in_stream_front_end
    with pytest.warns(DeprecationWarning, match="moves_rows_in_place is deprecated"):
        assert service.moves_rows_in_place


@pytest.mark.quick
def test_strided_rows_move_a_column_block_in_place(service):
    # Columns 2..5 of a 6 x 8 float32 matrix land as columns 4..7 of another; a transposed cut
    # (rows of 8 bytes on the sender, 16 on the receiver) of the same stream works too.
    src = np.arange(48, dtype=np.float32).reshape(6, 8)
    dst = np.zeros((6, 8), dtype=np.float32)
    service.register_send(1, src, 2 * 4, 16, 0, rows=(6,), pitches=(32,))
    service.register_receive(1, dst, 4 * 4, 16, 0, rows=(6,), pitches=(32,))
    flat = np.zeros(24, dtype=np.float32)
    service.register_send(2, src, 2 * 4, 8, 0, rows=(6, 2), pitches=(32, 8))
    service.register_receive(2, flat, 0, 96, 0)
    service.schedule()
    service.run()
    np.testing.assert_array_equal(dst[:, 4:], src[:, 2:6])
    assert not dst[:, :4].any()
    np.testing.assert_array_equal(flat, src[:, 2:6].ravel())


def test_strided_rows_that_disagree_or_overreach_are_refused(service):
    matrix = np.zeros((4, 8), dtype=np.uint8)
    with pytest.raises(reshard.ReshardError, match="one stride") as error:
        service.register_send(4, matrix, 0, 4, 0, rows=(4,), pitches=())
    assert error.value.tasks == [4]
    with pytest.raises(reshard.ReshardError, match="reaches byte 36, outside") as error:
        service.register_receive(5, matrix, 4, 8, 0, rows=(4,), pitches=(8,))
    assert error.value.tasks == [5]
    with pytest.raises(reshard.ReshardError, match="row extent -1"):
        service.register_send(6, matrix, 0, 4, 0, rows=(-1,), pitches=(8,))


@pytest.mark.quick
def test_verify_mode_passes_clean_runs_and_names_a_corrupted_task(service):
    service.verify = True
    assert service.verify
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    service.register_send(7, src, 0, 32, 0)
    service.register_receive(7, dst, 32, 32, 0)
    service.schedule()
    service.run()
    np.testing.assert_array_equal(dst[32:], src[:32])
    reshard._core._corrupt_receives_after_run(service._service, 7)
    with pytest.raises(reshard.ReshardError, match="task 7 ") as error:
        service.run()
    assert error.value.code == "integrity"
    reshard._core._corrupt_receives_after_run(service._service, None)
    service.run()  # the service stays usable


@pytest.mark.quick
def test_a_transport_named_in_code_wins_over_the_environment(monkeypatch):
    # RESHARD_TRANSPORT names a transport this CPU job cannot use: code that names "host" must
    # still get the host transport, with or without settings; "auto" takes the environment's.
    monkeypatch.setenv("RESHARD_TRANSPORT", "cuda")
    for service in (reshard.CopyService("host"), reshard.CopyService("host", timeout=5)):
        try:
            assert service.options.transport == "host"
            service.init("WARN")
            assert service.transport == "host"
        finally:
            service.finalize()
    left_to_the_job = reshard.CopyService()
    try:
        assert left_to_the_job.options.transport == "cuda"
    finally:
        left_to_the_job.finalize()


def test_service_settings_are_keywords_with_the_environment_as_default(monkeypatch):
    monkeypatch.setenv("RESHARD_TIMEOUT_S", "7")
    monkeypatch.setenv("RESHARD_CUDA_ENGINE", "ce")
    plain = reshard.CopyService("host")
    tuned = reshard.CopyService("host", timeout=2.5, chunk_bytes="4KiB", verify=True,
                                log_level="WARN", host={"staging_bytes": "16MiB"},
                                cuda={"engine": "sm", "same_device": "stream"},
                                nvshmem={"waits": "stream"},
                                advanced={"step_timing": True, "cuda_bytes_per_cta": "8KiB"})
    try:
        assert plain.options.timeout == 7.0 and plain.options.cuda.engine == "ce"
        assert plain.options.chunk_bytes is None and not plain.options.verify
        o = tuned.options
        assert (o.timeout, o.chunk_bytes, o.verify, o.log_level) == (2.5, 4096, True, "WARN")
        assert o.host.staging_bytes == 16 << 20
        assert (o.cuda.engine, o.cuda.same_device) == ("sm", "stream")
        assert (o.nvshmem.waits, plain.options.nvshmem.waits) == ("stream", "auto")
        assert o.advanced.step_timing and not plain.options.advanced.step_timing
        assert o.advanced.cuda_bytes_per_cta == 8192
        # The keywords reach the service: verify mode is on without set_verify.
        tuned.init()
        assert tuned.verify and not plain.init("WARN").verify
        src = np.arange(64, dtype=np.uint8)
        dst = np.zeros(64, dtype=np.uint8)
        tuned.register_send(1, src, 0, 64, 0)
        tuned.register_receive(1, dst, 0, 64, 0)
        tuned.schedule()
        tuned.run()
        np.testing.assert_array_equal(dst, src)
    finally:
        plain.finalize()
        tuned.finalize()


def test_tuning_and_diagnosis_under_their_former_names_work_with_a_warning():
    # advanced= holds tuning and diagnosis; debug= and cuda=/nccl='s tuning keys are its former
    # spelling, kept for one release.
    with pytest.warns(DeprecationWarning, match=r"advanced=\{'step_timing'"):
        former = reshard.CopyService("host", debug={"phase_timing": True, "cuda_unroll": 4},
                                     cuda={"engine": "sm", "ctas_per_peer": 16},
                                     nccl={"group_spans": 3})
    try:
        a = former.options.advanced
        assert (a.step_timing, a.cuda_unroll, a.cuda_ctas_per_peer, a.nccl_group_spans) == \
            (True, 4, 16, 3)
        assert former.options.cuda.engine == "sm"
        # The service's options speak the new names only.
        assert not former.options.debug.phase_timing and former.options.cuda.ctas_per_peer == 64
    finally:
        former.finalize()
    with pytest.warns(DeprecationWarning, match="cuda_ce_min_bytes"):
        options = reshard.service_options(cuda={"ce_min_bytes": "1MiB"})
    assert options.advanced.cuda_ce_min_bytes == 1 << 20
    with pytest.raises(ValueError, match="advanced.cuda_unroll"):
        reshard.service_options(advanced={"cuda_unroll": 6})


@pytest.mark.parametrize("settings, message", [
    (dict(timeoot=1), "unknown setting 'timeoot'"),
    (dict(cuda={"engin": "sm"}), "unknown setting 'engin'"),
    (dict(cuda="sm"), "takes a dict of cuda settings"),
    (dict(verify="yes"), "verify='yes' is not a bool"),
    (dict(cuda={"engine": "fast"}), "cuda.engine = 'fast' is not one of"),
    (dict(advanced={"cuda_unroll": 6}), "advanced.cuda_unroll = 6 is not 4 or 8"),
    (dict(nvshmem={"waits": "spin"}), "nvshmem.waits = 'spin' is not one of"),
    (dict(chunk_bytes=0), "chunk_bytes = 0 must be positive"),
    (dict(inter_node_transport="carrier-pigeon"), "unknown transport 'carrier-pigeon'"),
])
def test_unknown_or_out_of_range_settings_are_refused_naming_them(settings, message):
    with pytest.raises((TypeError, reshard.ReshardError), match=message):
        reshard.CopyService("host", **settings)


def test_read_only_source_is_accepted(service):
    src = np.arange(8, dtype=np.uint8)
    src.setflags(write=False)
    dst = np.zeros(8, dtype=np.uint8)
    service.register_send(1, src, 0, 8, 0)
    service.register_receive(1, dst, 0, 8, 0)
    service.schedule()
    service.run()
    np.testing.assert_array_equal(dst, src)


def test_jax_arrays_cross_through_dlpack_without_copies(service):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    with jax.default_device(jax.devices("cpu")[0]):  # JAX picks a GPU first where it has one
        src = jnp.arange(64, dtype=jnp.float32)
        dst_jax = jnp.zeros(16, dtype=jnp.float32)
    dst_np = np.zeros(64, np.float32)
    service.register_send(1, src, 16, 128, 0)      # elements 4..35 of a JAX array
    service.register_receive(1, dst_np, 0, 128, 0)
    service.register_send(2, src, 0, 64, 0)        # elements 0..15, into a JAX array in place
    service.register_receive(2, dst_jax, 0, 64, 0)
    service.schedule()
    service.run()
    np.testing.assert_array_equal(dst_np[:32], np.arange(4, 36, dtype=np.float32))
    assert not dst_np[32:].any()
    np.testing.assert_array_equal(np.asarray(dst_jax), np.arange(16, dtype=np.float32))


def test_registered_torch_parameters_move_and_non_arrays_are_refused_naming_the_task(service):
    torch = pytest.importorskip("torch")
    src = torch.nn.Parameter(torch.arange(32, dtype=torch.float32))  # requires gradients
    dst = torch.zeros(32)
    service.register_send(5, src, 0, 128, 0)
    service.register_receive(5, dst, 0, 128, 0)
    service.schedule()
    service.run()
    assert torch.equal(dst, src.detach())
    with pytest.raises(reshard.ReshardError, match="send buffer of task 6: list is not an array "
                       "reshard can read") as refused:
        service.register_send(6, [1, 2, 3], 0, 3, 0)
    assert refused.value.tasks == [6]


@pytest.mark.quick
def test_range_outside_the_buffer_is_refused_naming_the_task(service):
    with pytest.raises(reshard.ReshardError, match="task 3") as error:
        service.register_send(3, np.zeros(16, np.uint8), 10, 8, 0)
    assert error.value.code == "invalid argument"
    assert error.value.tasks == [3]


@pytest.mark.quick
def test_errors_form_one_hierarchy_that_is_also_pythons(service):
    # A refusal in the C++ core: an InvalidArgumentError, so a ValueError too.
    with pytest.raises(ValueError) as error:
        service.register_send(3, np.zeros(16, np.uint8), 10, 8, 0)
    assert isinstance(error.value, reshard.InvalidArgumentError)
    assert error.value.code == reshard.ErrorCode.INVALID_ARGUMENT and error.value.tasks == [3]
    assert error.value.retryable is False  # the call is to be mended, not made again
    # Requests that do not match: the same class, code "validation", the task named.
    service.register_send(7, np.zeros(8, np.uint8), 0, 8, 0)
    service.register_receive(7, np.zeros(16, np.uint8), 0, 16, 0)
    with pytest.raises(reshard.InvalidArgumentError) as error:
        service.schedule()
    assert error.value.code == reshard.ErrorCode.VALIDATION and 7 in error.value.tasks
    service.clear_requests()
    # A call out of order: an InvalidStateError (a RuntimeError, as every ReshardError).
    with pytest.raises(reshard.InvalidStateError) as error:
        service.run()
    assert isinstance(error.value, RuntimeError) and error.value.code == "invalid state"
    # A refusal made in Python: an object of the wrong type is a ReshardTypeError, a TypeError.
    with pytest.raises(TypeError) as error:
        reshard.task_id(1.5)
    assert isinstance(error.value, reshard.ReshardTypeError)
    assert isinstance(error.value, reshard.InvalidArgumentError)
    assert error.value.retryable is False
    # Every class's code is an ErrorCode, and the kinds that mean a built-in's are that too.
    kinds = {reshard.ReshardTimeoutError: TimeoutError, reshard.UnsupportedError: NotImplementedError,
             reshard.SystemCallError: OSError, reshard.PeerFailureError: RuntimeError,
             reshard.IntegrityError: RuntimeError}
    for kind, builtin in kinds.items():
        assert issubclass(kind, reshard.ReshardError) and issubclass(kind, builtin), kind
        assert reshard.ErrorCode(kind.code), kind


@pytest.mark.quick
def test_the_built_in_transforms_are_reshard_transforms():
    for transform in (reshard.make_mxfp8_transform(), reshard.make_cast_transform("float32"),
                      reshard.make_fp8_block_transform()):
        assert isinstance(transform, reshard.ReshardTransform), transform
    assert not isinstance(object(), reshard.ReshardTransform)


def test_non_contiguous_memory_is_refused_not_copied(service):
    with pytest.raises(reshard.ReshardError, match="not contiguous") as error:
        service.register_send(4, np.zeros((8, 8), np.float32)[:, ::2], 0, 4, 0)
    assert "numpy.ascontiguousarray" in str(error.value)


def test_read_only_destination_is_refused(service):
    dst = np.zeros(8, np.uint8)
    dst.setflags(write=False)
    with pytest.raises(reshard.ReshardError, match="read-only") as error:
        service.register_receive(1, dst, 0, 8, 0)
    assert error.value.tasks == [1]


@pytest.mark.parametrize("task", [-1, 1 << 64, hash("negative") | (1 << 70)])
def test_task_ids_outside_64_bits_are_refused_with_a_sentence(service, task):
    with pytest.raises(reshard.ReshardError, match=r"outside 0 \.\. 2\*\*64 - 1") as error:
        service.register_send(task, np.zeros(8, np.uint8), 0, 8, 0)
    assert error.value.code == "invalid argument"


def test_task_id_is_stable_across_processes_and_the_advice_names_it(service):
    key = ("layers.0.mlp.fc1.weight", 3, 5)
    here = reshard.task_id(key)
    code = ("import reshard; print(reshard.task_id(('layers.0.mlp.fc1.weight', 3, 5)), "
            "hash('layers.0.mlp.fc1.weight'))")
    env = dict(os.environ, PYTHONHASHSEED="random")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                           check=True).stdout.split() for _ in range(2)]
    assert [int(r[0]) for r in runs] == [here, here], "task_id differs between processes"
    assert runs[0][1] != runs[1][1], "Python's hash() was expected to differ between processes"
    assert 0 <= here < 1 << 64 and here != reshard.task_id(("layers.0.mlp.fc1.weight", 5, 3))
    assert reshard.task_id("a") != reshard.task_id(b"a") != reshard.task_id(("a",))
    with pytest.raises(TypeError, match="takes strings, bytes, integers and tuples"):
        reshard.task_id(1.5)
    with pytest.raises(reshard.ReshardError, match=r"reshard\.task_id\(key\)"):
        service.register_send(-1, np.zeros(8, np.uint8), 0, 8, 0)
    src = np.arange(16, dtype=np.uint8)
    dst = np.zeros(16, np.uint8)
    service.register_send(here, src, 0, 16, 0)
    service.register_receive(here, dst, 0, 16, 0)
    service.schedule()
    service.run()
    np.testing.assert_array_equal(dst, src)


@pytest.mark.quick
def test_whole_tensors_register_by_their_bytes(service):
    # register_send(task, tensor, pe): every byte, not a count of elements taken for bytes.
    src = np.arange(1000, dtype=np.float32)
    dst = np.zeros(1000, np.float32)
    service.register_send(1, src, 0)
    service.register_receive(1, dst, src_pe=0)
    service.schedule()
    service.run()
    np.testing.assert_array_equal(dst, src)
    with pytest.raises(reshard.ReshardError, match=r"pass \(tensor, dest_pe\) for the whole"):
        service.register_send(2, src, 0, 4000)
    with pytest.raises(reshard.ReshardError, match="cannot tell the size of a object"):
        service.register_send(3, object(), 0)


def test_should_transform_given_a_name_says_to_pass_a_param_spec():
    # Megatron's hooks take a parameter's name; the built-ins need its shape and dtype too.
    mx = reshard.make_mxfp8_transform(side="receiver")
    assert mx.should_transform(reshard.ParamSpec("w", [256, 256], "bfloat16"))
    assert not mx.should_transform(reshard.ParamSpec("norm", [256], "bfloat16"))
    with pytest.raises(reshard.ReshardError, match=r"pass a ParamSpec, e\.g\. should_transform"):
        mx.should_transform("layers.0.mlp.fc1.weight")


def test_a_transport_this_build_lacks_says_how_to_get_it():
    missing = [t for t in ("nvshmem", "nccl", "cuda") if t not in reshard.available_transports()]
    if not missing:
        pytest.skip("this build has every transport")
    advice = {"nvshmem": "pip install nvidia-nvshmem-cu13", "nccl": "pip install nvidia-nccl-cu13",
              "cuda": "where CUDA (nvcc) is found"}
    with pytest.raises(reshard.ReshardError, match="not part of this build") as error:
        reshard.CopyService(missing[0], rank=0, world_size=1).init("WARN")
    assert advice[missing[0]] in str(error.value), str(error.value)


def test_negative_size_is_refused_naming_the_argument(service):
    with pytest.raises(reshard.ReshardError, match="the size -8 is not a non-negative integer"):
        service.register_send(5, np.zeros(8, np.uint8), 0, -8, 0)


def test_run_after_new_requests_says_the_schedule_is_stale(service):
    src, dst = np.arange(8, dtype=np.uint8), np.zeros(16, np.uint8)
    service.register_send(1, src, 0, 8, 0)
    service.register_receive(1, dst, 0, 8, 0)
    service.schedule()
    service.run()
    service.register_send(2, src, 0, 8, 0)
    with pytest.raises(reshard.ReshardError, match="registered since the last schedule"):
        service.run()


def test_plain_uint16_arrays_are_asked_for_their_dtype(service):
    plan = reshard.make_reshard_plan(*[reshard.build_layout(reshard.toy_model(1, 64),
                                                            reshard.Parallelism())] * 2)
    tensors = {p.name: np.zeros(p.shape, np.uint16) for p in plan.params}
    with pytest.raises(reshard.ReshardError, match=r'LocalTensor\(array, dtype="bfloat16"\)'):
        reshard.execute_reshard_plan(plan, tensors, dict(tensors), service)


def test_peer_out_of_range_is_refused(service):
    with pytest.raises(reshard.ReshardError, match="PE") as error:
        service.register_send(1, np.zeros(8, np.uint8), 0, 8, 5)
    assert error.value.tasks == [1]


def test_unknown_transport_is_refused():
    with pytest.raises(reshard.ReshardError, match="transport"):
        reshard.CopyService(transport="carrier-pigeon")


def test_bad_bootstrap_is_refused():
    with pytest.raises(TypeError):
        reshard.make_bootstrap(3.5)
    with pytest.raises(ValueError):
        reshard.make_bootstrap("no-port-here", rank=0, world_size=1)


@pytest.mark.quick
def test_the_planner_classes_say_what_they_are():
    """Each planner class has a docstring, and its repr says what the object holds instead of an
    address."""
    model = reshard.toy_model(layers=2, hidden=256)
    trainer = reshard.build_layout(model, reshard.Parallelism(tp=2))
    plan = reshard.make_reshard_plan(trainer, reshard.build_layout(model, reshard.Parallelism()))
    objects = [model, model.params[0], model.params[0].spec, reshard.Parallelism(tp=2), trainer,
               plan, plan.ops[0], plan.stats]
    for obj in objects:
        assert type(obj).__doc__, f"{type(obj).__name__} has no docstring"
        assert " object at 0x" not in repr(obj), f"{type(obj).__name__}: {obj!r}"
        assert repr(obj).startswith(type(obj).__name__), repr(obj)
    assert "layers=2" in repr(model) and "PEs 0..1" in repr(trainer)
    assert model.params[0].stage in ("layer", "first", "last")
    assert "split_row_align" in reshard.make_reshard_plan.__doc__
    assert "torch.chunk" in reshard.build_layout.__doc__


@pytest.mark.quick
def test_the_former_rank_names_of_the_planner_warn_and_say_what_the_pe_names_say():
    model = reshard.toy_model(layers=2, hidden=256)
    engine = reshard.build_layout(model, reshard.Parallelism(tp=2, first_pe=2))
    with pytest.warns(DeprecationWarning, match="use first_pe="):
        former = reshard.Parallelism(tp=2, rank_offset=2)
    assert reshard.build_layout(model, former).max_pe == engine.max_pe == 3
    with pytest.raises(ValueError, match="first_pe = 2 and rank_offset"):
        reshard.build_layout(model, reshard.Parallelism(tp=2, first_pe=2, rank_offset=1))
    plan = reshard.make_reshard_plan(reshard.build_layout(model, reshard.Parallelism()), engine)
    op = plan.ops[0]
    assert op.src_pe == 0 and op.dst_pe in (2, 3) and "PE 0 -> " in repr(op)
    with pytest.warns(DeprecationWarning, match="TransferOp.src_pe"):
        assert op.src_rank == op.src_pe
    with pytest.warns(DeprecationWarning, match="TransferOp.dst_pe"):
        assert op.dst_rank == op.dst_pe
    with pytest.warns(DeprecationWarning, match="Layout.max_pe"):
        assert engine.max_rank == 3


@pytest.mark.quick
def test_plan_is_deterministic_and_conserves_bytes():
    model = reshard.toy_model(2, 256, 4)
    a = reshard.build_layout(model, reshard.Parallelism(tp=2, dp=2, ep=2))
    b = reshard.build_layout(model, reshard.Parallelism(tp=4, ep=4))
    plan, again = reshard.make_reshard_plan(a, b), reshard.make_reshard_plan(a, b)
    assert plan.fingerprint == again.fingerprint
    assert [op.task_id for op in plan.ops] == [op.task_id for op in again.ops]
    # Every destination element once: the ops' bytes add up to the destination layout's bytes.
    dst_bytes = 0
    for param in plan.params:
        for rank in range(4):
            for _, extent, _ in b.pieces(rank, param.name):
                dst_bytes += int(np.prod(extent)) * (param.bytes // int(np.prod(param.shape)))
    assert sum(op.bytes for op in plan.ops) == dst_bytes == plan.stats.total_bytes
    assert len({op.task_id for op in plan.ops}) == len(plan.ops)


def test_plan_refuses_uncovered_destination():
    model = reshard.toy_model(1, 128)
    src = reshard.Layout()
    for param in model.params:
        src.add_param(param.spec)
    dst = reshard.build_layout(model, reshard.Parallelism(tp=2))
    with pytest.raises(reshard.ReshardError, match=model.params[0].spec.name):
        reshard.make_reshard_plan(src, dst)


def test_bad_transform_options_are_refused():
    with pytest.raises(reshard.ReshardError, match="side"):
        reshard.make_mxfp8_transform(side="middle")
    with pytest.raises(reshard.ReshardError, match="rounding must be 'ocp', 'round_up' or "
                       "'megatron', not 'nearest'"):
        reshard.make_mxfp8_transform(rounding="nearest")
    with pytest.raises(reshard.ReshardError, match="scale_layout must be 'row_major' or "
                       "'swizzled', not 'blocked'"):
        reshard.make_mxfp8_transform(scale_layout="blocked")


def test_fp8_transforms_say_what_scale_tensor_a_destination_needs():
    mx = reshard.make_mxfp8_transform().destination_scale([8, 96, 256])
    assert (mx.dtype, mx.shape, mx.nbytes) == ("float8_e8m0fnu", (8, 96, 8), 8 * 96 * 8)
    block = reshard.make_fp8_block_transform().destination_scale([300, 260])
    assert (block.dtype, block.shape, block.nbytes) == ("float32", (3, 3), 36)
    assert reshard.make_cast_transform("fp32").destination_scale([4, 4]) is None
    with pytest.raises(reshard.ReshardError, match="multiple of 32"):
        reshard.make_mxfp8_transform().destination_scale([4, 48])
    with pytest.raises(reshard.ReshardError, match="2 or more dimensions"):
        reshard.make_fp8_block_transform().destination_scale([256])
    # Megatron's preset: its scales swizzled into 128 x 4 tiles, padded (one byte array).
    megatron = reshard.make_mxfp8_transform(rounding="megatron", scale_layout="swizzled")
    swizzled = megatron.destination_scale([300, 4096 + 32])
    assert (swizzled.dtype, swizzled.shape) == ("float8_e8m0fnu", (3 * 33 * 512,))
    assert megatron.name == "mxfp8-sender-megatron-swizzled"
    with pytest.raises(reshard.ReshardError, match="swizzled scales are laid out for 2-D tensors"):
        megatron.destination_scale([4, 256, 256])


class _BrokenTransform(reshard.ReshardTransform):
    """Returns what the test asks for from its hooks."""

    name = "broken"

    def __init__(self, send, recv):
        self.send, self.recv = send, recv

    def should_transform(self, param):
        return True

    def prepare_send(self, name, slice, tensor, stream):
        return self.send(slice)

    def prepare_recv(self, name, slice, tensor):
        return self.recv(slice)

    def finalize_recv(self, name, slice, tensor, buffers, stream):
        pass


def _one_pe_plan():
    model = reshard.toy_model(1, 64)
    layout = reshard.build_layout(model, reshard.Parallelism())
    plan = reshard.make_reshard_plan(layout, layout)
    src = {p.name: reshard.LocalTensor(np.zeros(p.shape, np.uint16), dtype="bfloat16")
           for p in plan.params}
    dst = {p.name: reshard.LocalTensor(np.zeros(p.shape, np.uint16), dtype="bfloat16")
           for p in plan.params}
    return plan, src, dst


@pytest.mark.parametrize("budget", ["lots", "-1MiB", -5, 1.5])
def test_a_staging_budget_that_is_no_byte_count_is_refused(service, budget):
    plan, src, dst = _one_pe_plan()
    with pytest.raises(reshard.ReshardError, match="staging_budget"):
        reshard.execute_reshard_plan(plan, src, dst, service, staging_budget=budget)


@pytest.mark.parametrize("budget", ["1MiB", "1.5 GiB", "4096", "unlimited", " Unlimited "])
def test_a_staging_budget_reads_as_the_environment_variable_does(service, budget):
    plan, src, dst = _one_pe_plan()
    assert reshard.execute_reshard_plan(plan, src, dst, service, staging_budget=budget).phases == 1


def test_arguments_after_transform_by_position_still_work_with_a_deprecation_warning(service):
    plan, src, dst = _one_pe_plan()
    with pytest.warns(DeprecationWarning, match="pass stream=, staging_budget= by keyword"):
        report = reshard.execute_reshard_plan(plan, src, dst, service, None, None, 0)
    assert report.staging_bytes == 0
    with pytest.warns(DeprecationWarning, match="rerun_reshard_plan"):
        reshard.rerun_reshard_plan(plan, service, None, None)
    with pytest.raises(TypeError, match="at most 4 arguments after transform"):
        reshard.execute_reshard_plan(plan, src, dst, service, None, None, 0, True, True, 1)
    with pytest.raises(reshard.ReshardTypeError, match="staging_budget given by position and by"):
        reshard.execute_reshard_plan(plan, src, dst, service, None, None, 0, staging_budget=1)


def test_plain_refit_needs_no_staging_and_runs_within_a_budget_of_zero(service):
    plan, src, dst = _one_pe_plan()
    for tensor in src.values():
        tensor.data[...] = np.arange(tensor.data.size, dtype=np.uint16).reshape(tensor.data.shape)
    report = reshard.execute_reshard_plan(plan, src, dst, service, staging_budget=0)
    assert (report.staging_bytes, report.phases) == (0, 1)
    for name in src:
        np.testing.assert_array_equal(dst[name].data, src[name].data)


def test_a_rerun_moves_the_new_values_of_the_tensors_it_was_given(service):
    plan, src, dst = _one_pe_plan()
    with pytest.raises(reshard.ReshardError, match="call execute_reshard_plan") as refused:
        reshard.rerun_reshard_plan(plan, service)
    assert refused.value.code == "invalid state"
    reshard.execute_reshard_plan(plan, src, dst, service)
    # The second execute checks the tensors and agrees (host time it reports); a rerun does neither.
    executed = reshard.execute_reshard_plan(plan, src, dst, service)
    assert not executed.rescheduled
    assert executed.timing.check_seconds > 0 and executed.timing.agree_seconds > 0
    # The timings under their former names, for one release: the same values, each read warning.
    with pytest.warns(DeprecationWarning, match="ReshardReport.timing.agree_seconds"):
        assert executed.agree_seconds == executed.timing.agree_seconds
    with pytest.warns(DeprecationWarning, match="ReshardReport.timing.check_seconds"):
        assert executed.check_seconds == executed.timing.check_seconds
    for tensor in src.values():  # the trainer's next weights, in place
        tensor.data[...] = np.arange(tensor.data.size, dtype=np.uint16).reshape(tensor.data.shape)
    report = reshard.rerun_reshard_plan(plan, service)
    assert not report.rescheduled
    assert report.timing.check_seconds == report.timing.agree_seconds == 0
    for name in src:
        np.testing.assert_array_equal(dst[name].data, src[name].data)
    # A transform it was never executed with is refused, as is a rerun after clear_requests().
    with pytest.raises(reshard.ReshardError, match="never passed to execute_reshard_plan"):
        reshard.rerun_reshard_plan(plan, service, _BrokenTransform(lambda s: [], lambda s: []))
    service.clear_requests()
    with pytest.raises(reshard.ReshardError, match="call execute_reshard_plan"):
        reshard.rerun_reshard_plan(plan, service)


@pytest.mark.quick
def test_a_bound_refit_holds_its_tensors_runs_and_updates(service):
    plan, src, dst = _one_pe_plan()
    refit = reshard.bind(plan, src, dst, service)
    assert refit.report.rescheduled
    held = [weakref.ref(t.data) for t in (*src.values(), *dst.values())]
    for step in range(3):
        for tensor in src.values():  # the trainer's next weights, in place
            tensor.data[...] = (np.arange(tensor.data.size, dtype=np.uint16) * (step + 3)
                                ).reshape(tensor.data.shape)
        report = refit.run()
        assert not report.rescheduled
        assert report.timing.check_seconds == report.timing.agree_seconds == 0
        for name in src:
            np.testing.assert_array_equal(dst[name].data, src[name].data)
    # The refit holds its tensors: dropped by the caller, they are not freed under it.
    kept_dst = dst
    del src, dst, tensor
    gc.collect()
    assert all(ref() is not None for ref in held)
    # update(): one destination in new memory lands there; the same tensors schedule nothing.
    name = next(iter(kept_dst))
    fresh = reshard.LocalTensor(np.zeros_like(kept_dst[name].data), dtype="bfloat16")
    assert refit.update(dst={name: fresh}).rescheduled
    refit.run()
    np.testing.assert_array_equal(fresh.data, refit.sources[name].data)
    assert not refit.update(dst={name: fresh}).rescheduled
    with pytest.raises(reshard.ReshardError, match="'bogus.weight' is not a destination tensor"):
        refit.update(dst={"bogus.weight": fresh})
    refit.run()  # a refused update leaves the refit as it was
    # close() lets go of the tensors and refuses to run.
    refit.close()
    del kept_dst, fresh
    gc.collect()
    assert all(ref() is None for ref in held)


def test_execute_again_with_the_same_tensors_notices_storage_swapped_in_place(service):
    # The same dicts of the same objects run the prepared refit without converting every tensor
    # again; a tensor given other storage in place (param.data = ...), a value replaced in the
    # dict or a LocalTensor's field reassigned is noticed, and its bytes go to the new memory.
    torch = pytest.importorskip("torch")
    plan, arrays, _ = _one_pe_plan()
    src = {name: torch.nn.Parameter(torch.zeros(t.data.shape, dtype=torch.bfloat16),
                                    requires_grad=False) for name, t in arrays.items()}
    dst = {name: torch.zeros(t.data.shape, dtype=torch.bfloat16) for name, t in arrays.items()}
    wrapped = {name: reshard.LocalTensor(torch.zeros(t.data.shape, dtype=torch.bfloat16))
               for name, t in arrays.items()}
    for destinations in (dst, wrapped):
        assert reshard.execute_reshard_plan(plan, src, destinations, service).rescheduled

        def landed(name):
            value = destinations[name]
            return value.data if isinstance(value, reshard.LocalTensor) else value

        for step in range(1, 4):
            for parameter in src.values():
                parameter.data.fill_(step)
            report = reshard.execute_reshard_plan(plan, src, destinations, service)
            assert not report.rescheduled
            assert all(torch.equal(landed(name), src[name]) for name in src), step
        first, last = sorted(src)[0], sorted(src)[-1]
        swapped = torch.zeros_like(landed(first))
        if isinstance(destinations[first], reshard.LocalTensor):
            destinations[first].data = swapped           # a field reassigned
        else:
            destinations[first].data = swapped           # other storage, same object
        src[last].data = torch.full_like(src[last], 7)   # a source's storage swapped too
        report = reshard.execute_reshard_plan(plan, src, destinations, service)
        assert report.rescheduled
        assert torch.equal(swapped, src[first]) and torch.equal(landed(last), src[last])
        destinations[first] = (reshard.LocalTensor(torch.zeros_like(swapped))
                               if destinations is wrapped else torch.zeros_like(swapped))
        assert reshard.execute_reshard_plan(plan, src, destinations, service).rescheduled
        assert torch.equal(landed(first), src[first])


def test_execute_again_reads_each_address_the_way_its_type_says(service):
    # The same-dicts check reads a NumPy array's address from the array, a tensor's through
    # PyTorch's C data_ptr directly, and a type that overrides data_ptr in Python through that
    # override, every call: a subclass's swapped storage is noticed either way.
    torch = pytest.importorskip("torch")
    plan, arrays, _ = _one_pe_plan()
    calls = []

    class Counted(torch.Tensor):
        def data_ptr(self):
            calls.append(self)
            return super().data_ptr()

    class Plain(torch.Tensor):
        pass

    names = sorted(arrays)
    src = {name: torch.full(arrays[name].data.shape, i + 1, dtype=torch.bfloat16).as_subclass(
        Counted if i % 2 else Plain) for i, name in enumerate(names)}
    dst = {name: reshard.LocalTensor(np.zeros(arrays[name].data.shape, np.uint16),
                                     dtype="bfloat16") for name in names}
    assert reshard.execute_reshard_plan(plan, src, dst, service).rescheduled
    before = len(calls)
    assert not reshard.execute_reshard_plan(plan, src, dst, service).rescheduled
    assert len(calls) - before == sum(isinstance(t, Counted) for t in src.values())
    for i, name in enumerate(names[:2]):  # one Plain, one Counted
        src[name].data = torch.full_like(src[name], 50 + i)
    assert reshard.execute_reshard_plan(plan, src, dst, service).rescheduled
    for name in names:
        assert np.array_equal(dst[name].data, src[name].view(torch.int16).numpy().view(np.uint16))
    dst[names[-1]] = reshard.LocalTensor(np.zeros_like(dst[names[-1]].data), dtype="bfloat16")
    assert reshard.execute_reshard_plan(plan, src, dst, service).rescheduled
    assert np.array_equal(dst[names[-1]].data,
                          src[names[-1]].view(torch.int16).numpy().view(np.uint16))
    # A LocalTensor's dtype field reassigned is seen too: the call checks again and refuses it.
    dst[names[0]].dtype = "float16"
    with pytest.raises(reshard.ReshardError, match=f"'{names[0]}' on PE 0 is float16"):
        reshard.execute_reshard_plan(plan, src, dst, service)
    dst[names[0]].dtype = "bfloat16"
    assert reshard.execute_reshard_plan(plan, src, dst, service).rescheduled


def test_execute_again_notices_a_view_moved_within_the_same_storage(service):
    # A destination that is a view into one buffer, given a view of the same buffer one element
    # further on (the same storage, another offset), is noticed, and its bytes land there; a
    # source that requires gradients is read and checked the same way.
    torch = pytest.importorskip("torch")
    plan, arrays, _ = _one_pe_plan()
    names = sorted(arrays)
    src = {name: torch.full(arrays[name].data.shape, i + 1, dtype=torch.bfloat16)
           for i, name in enumerate(names)}
    src[names[-1]].requires_grad_(True)
    sizes = [arrays[name].data.size for name in names]
    base = torch.zeros(sum(sizes) + 1, dtype=torch.bfloat16)
    starts = [sum(sizes[:i]) for i in range(len(names))]
    dst = {name: base[start:start + size].view(arrays[name].data.shape)
           for name, start, size in zip(names, starts, sizes)}
    assert reshard.execute_reshard_plan(plan, src, dst, service).rescheduled
    assert not reshard.execute_reshard_plan(plan, src, dst, service).rescheduled
    last = names[-1]
    dst[last].data = base[starts[-1] + 1:starts[-1] + 1 + sizes[-1]].view(dst[last].shape)
    assert reshard.execute_reshard_plan(plan, src, dst, service).rescheduled
    assert not reshard.execute_reshard_plan(plan, src, dst, service).rescheduled
    for name in names:
        assert torch.equal(dst[name], src[name].detach()), name
    with torch.no_grad():
        src[last].data = torch.full_like(src[last], 7)
    assert reshard.execute_reshard_plan(plan, src, dst, service).rescheduled
    assert torch.equal(dst[last], src[last].detach())


def test_execute_again_notices_a_local_tensors_fields_reassigned_in_a_subclass_too(service):
    # A LocalTensor's fields are read at their slots' offsets where the object is a LocalTensor
    # itself, by name where it is of a subclass (which may keep its own attributes): a field
    # reassigned is noticed both ways, and the same object kept weakly referable.
    plan, arrays, _ = _one_pe_plan()

    class Tagged(reshard.LocalTensor):
        pass

    names = sorted(arrays)
    src = {name: reshard.LocalTensor(np.full(arrays[name].data.shape, i + 1, np.uint16),
                                     dtype="bfloat16") for i, name in enumerate(names)}
    dst = {name: (Tagged if i % 2 else reshard.LocalTensor)(
        np.zeros(arrays[name].data.shape, np.uint16), dtype="bfloat16")
        for i, name in enumerate(names)}
    dst[names[1]].tag = "engine"
    assert weakref.ref(dst[names[0]])() is dst[names[0]]
    assert reshard.execute_reshard_plan(plan, src, dst, service).rescheduled
    assert not reshard.execute_reshard_plan(plan, src, dst, service).rescheduled
    for name in names[:2]:  # a LocalTensor's and a Tagged's
        dst[name].data = np.zeros_like(dst[name].data)
        src[name].data = np.full_like(src[name].data, 9)
        assert reshard.execute_reshard_plan(plan, src, dst, service).rescheduled, name
        assert not reshard.execute_reshard_plan(plan, src, dst, service).rescheduled, name
    for name in names:
        assert np.array_equal(dst[name].data, src[name].data), name
    dst[names[1]].dtype = "float16"
    with pytest.raises(reshard.ReshardError, match=f"'{names[1]}' on PE 0 is float16"):
        reshard.execute_reshard_plan(plan, src, dst, service)


def test_refused_calls_do_not_pile_up_their_tensors_on_the_service(service):
    # A failed call's tensors stay held (the refit may have prepared with them) until a call
    # succeeds, but a loop of refused calls holds one set of them, not every set.
    plan, src, dst = _one_pe_plan()
    reshard.execute_reshard_plan(plan, src, dst, service)
    refused = []
    for _ in range(5):
        _, bad_src, bad_dst = _one_pe_plan()
        bad_src.pop(next(iter(bad_src)))
        refused.append(weakref.ref(next(iter(bad_dst.values())).data))
        with pytest.raises(reshard.ReshardError, match="no source tensor"):
            reshard.execute_reshard_plan(plan, bad_src, bad_dst, service)
        del bad_src, bad_dst
    gc.collect()
    assert sum(ref() is not None for ref in refused) == 1
    reshard.execute_reshard_plan(plan, src, dst, service)
    gc.collect()
    assert all(ref() is None for ref in refused)


@pytest.mark.quick
def test_a_refit_on_the_host_transport_cannot_be_captured_in_a_cuda_graph(service):
    plan, src, dst = _one_pe_plan()
    refit = reshard.bind(plan, src, dst, service)
    with pytest.raises(reshard.UnsupportedError, match="runs on the host transport; only the cuda"):
        refit.capture_graph()
    refit.run()  # the refusal leaves the refit usable
    for name in src:
        np.testing.assert_array_equal(dst[name].data, src[name].data)
    staged = reshard.bind(plan, src, dst, service, staged=True)
    with pytest.raises(reshard.InvalidStateError, match="capture stage\\(\\) and commit\\(\\)"):
        staged.capture_graph()
    staged.close()
    with pytest.raises(reshard.InvalidStateError, match="closed; bind it again"):
        staged.capture_graph()


def test_a_device_given_for_one_bootstrap_is_not_set_for_the_process(monkeypatch):
    monkeypatch.delenv("RESHARD_DEVICE", raising=False)
    reshard.make_bootstrap(None, device=3)
    assert "RESHARD_DEVICE" not in os.environ


def test_a_bound_refit_whose_schedule_went_refuses_to_run(service):
    plan, src, dst = _one_pe_plan()
    first = reshard.bind(plan, src, dst, service)
    _, src2, dst2 = _one_pe_plan()
    second = reshard.bind(plan, src2, dst2, service)
    with pytest.raises(reshard.ReshardError, match="no longer holds this refit's schedule"):
        first.run()
    second.run()
    service.clear_requests()
    with pytest.raises(reshard.ReshardError, match="no longer holds this refit's schedule") as e:
        second.run()
    assert e.value.code == "invalid state"


def test_a_bound_refit_converts_with_a_transform_shared_by_others(service):
    # One transform object, a description: two refits on two services convert with it, and
    # execute_reshard_plan with a fresh object of the same description reuses its schedule.
    cast = reshard.make_cast_transform("float32")
    plan, src, dst = _one_pe_plan()
    for tensor in src.values():
        tensor.data[...] = np.arange(tensor.data.size, dtype=np.uint16).reshape(tensor.data.shape)
    wide = {name: reshard.LocalTensor(np.zeros(t.data.shape, np.float32)) for name, t in dst.items()}
    other = reshard.CopyService(transport="host").init("WARN")
    try:
        refits = [reshard.bind(plan, src, wide, s, cast) for s in (service, other)]
        for refit in refits:
            for tensor in wide.values():
                tensor.data[...] = -1
            refit.run()
            for name, tensor in src.items():
                expected = (tensor.data.astype(np.uint32) << 16).view(np.float32)
                np.testing.assert_array_equal(wide[name].data, expected)
        assert reshard.execute_reshard_plan(plan, src, wide, other,
                                            reshard.make_cast_transform("float32")).rescheduled
        for _ in range(3):
            assert not reshard.execute_reshard_plan(
                plan, src, wide, other, reshard.make_cast_transform("float32")).rescheduled
    finally:
        other.finalize()


def test_the_service_keeps_the_tensors_of_its_last_refit_alive_for_reruns(service):
    plan, src, dst = _one_pe_plan()
    reshard.execute_reshard_plan(plan, src, dst, service)
    arrays = [t.data for t in (*src.values(), *dst.values())]
    held = [weakref.ref(a) for a in arrays]
    del src, dst, arrays
    gc.collect()
    # Dropped by the caller, they are what a rerun reads and writes: their memory must not be freed.
    assert all(ref() is not None for ref in held)
    reshard.rerun_reshard_plan(plan, service)
    # A new refit takes the place of the old one's tensors; clear_requests() lets go of them all.
    _, src, dst = _one_pe_plan()
    reshard.execute_reshard_plan(plan, src, dst, service)
    gc.collect()
    assert all(ref() is None for ref in held)
    newer = [weakref.ref(t.data) for t in (*src.values(), *dst.values())]
    del src, dst
    service.clear_requests()
    gc.collect()
    assert all(ref() is None for ref in newer)


def test_where_colocated_slices_are_quantized_is_a_keyword(service):
    # Host memory: no rank is on a GPU, so both ways quantize on arrival and write the same bits.
    model = reshard.toy_model(1, 64)
    layout = reshard.build_layout(model, reshard.Parallelism())
    plan = reshard.make_reshard_plan(layout, layout)
    transform = reshard.make_mxfp8_transform("receiver")
    rng = np.random.default_rng(5)
    src = {p.name: reshard.LocalTensor(rng.integers(0x3000, 0x4000, p.shape, dtype=np.uint16),
                                       dtype="bfloat16") for p in plan.params}
    results = []
    for on_sender in (True, False):
        dst = {}
        for p in plan.params:
            if transform.should_transform(p):
                scale = transform.destination_scale(list(p.shape))
                dst[p.name] = reshard.LocalTensor(np.zeros(p.shape, np.uint8),
                                                  scale=np.zeros(scale.shape, np.uint8),
                                                  dtype="float8_e4m3")
            else:
                dst[p.name] = reshard.LocalTensor(np.zeros(p.shape, np.uint16), dtype="bfloat16")
        reshard.execute_reshard_plan(plan, src, dst, service, transform,
                                     quantize_colocated_on_sender=on_sender)
        results.append(dst)
    assert any(transform.should_transform(p) for p in plan.params)
    for name in results[0]:
        np.testing.assert_array_equal(results[0][name].data, results[1][name].data)
        if results[0][name].scale is not None:
            assert results[0][name].scale.any()
            np.testing.assert_array_equal(results[0][name].scale, results[1][name].scale)


@pytest.mark.quick
@pytest.mark.parametrize("kind", ["mxfp8", "fp8-block"])
def test_a_scale_tensor_of_another_type_or_shape_is_refused(service, kind):
    # float32 is the natural mistake for MXFP8 (block FP8 uses float32 scales): its E8M0 bytes
    # would land in the first quarter of the array. Refused before any byte moves, naming the
    # type the transform writes; the right type (or bytes for E8M0) and shape run.
    model = reshard.toy_model(1, 256)
    layout = reshard.build_layout(model, reshard.Parallelism())
    plan = reshard.make_reshard_plan(layout, layout)
    transform = (reshard.make_mxfp8_transform("receiver") if kind == "mxfp8"
                 else reshard.make_fp8_block_transform("receiver"))
    src = {p.name: reshard.LocalTensor(np.full(p.shape, 0x3F80, np.uint16), dtype="bfloat16")
           for p in plan.params}
    right = np.uint8 if kind == "mxfp8" else np.float32
    wrong = np.float32 if kind == "mxfp8" else np.uint8

    def destinations(scale_dtype, reshape=None):
        dst = {}
        for p in plan.params:
            if transform.should_transform(p):
                shape = tuple(transform.destination_scale(list(p.shape)).shape)
                if reshape is not None:
                    shape = reshape(shape)
                dst[p.name] = reshard.LocalTensor(np.zeros(p.shape, np.uint8),
                                                  scale=np.zeros(shape, scale_dtype),
                                                  dtype="float8_e4m3")
            else:
                dst[p.name] = reshard.LocalTensor(np.zeros(p.shape, np.uint16), dtype="bfloat16")
        return dst

    wanted = "float8_e8m0" if kind == "mxfp8" else "float32"
    # A smaller type has too few bytes, which the byte count refuses already.
    if np.dtype(wrong).itemsize >= np.dtype(right).itemsize:
        with pytest.raises(reshard.ReshardError, match=f"scale tensor is .*{wanted}") as refused:
            reshard.execute_reshard_plan(plan, src, destinations(wrong), service, transform)
        assert "destination_scale(" in str(refused.value)
    transposed = lambda shape: tuple(reversed(shape)) + (1,)  # noqa: E731
    with pytest.raises(reshard.ReshardError, match="scale tensor has shape"):
        reshard.execute_reshard_plan(plan, src, destinations(right, transposed), service,
                                     transform)
    dst = destinations(right)
    reshard.execute_reshard_plan(plan, src, dst, service, transform)
    assert all(t.scale.any() for t in dst.values() if t.scale is not None)
    flat = destinations(right, lambda shape: (int(np.prod(shape)),))
    reshard.execute_reshard_plan(plan, src, flat, service, transform)


@pytest.mark.quick
def test_a_tensor_under_a_name_the_plan_lacks_is_refused_unless_not_strict(service):
    # An engine parameter the model spec lacks would never be written: refused by default,
    # naming it (execute_reshard_plan and bind); strict=False ignores it.
    plan, src, dst = _one_pe_plan()
    extra = dict(dst, **{"bogus.weight": reshard.LocalTensor(np.zeros(4, np.uint16),
                                                             dtype="bfloat16")})
    with pytest.raises(reshard.ReshardError, match="'bogus.weight' on PE 0 is not a parameter"):
        reshard.execute_reshard_plan(plan, src, extra, service)
    with pytest.raises(reshard.ReshardError, match="'bogus.weight' on PE 0 is not a parameter"):
        reshard.bind(plan, src, extra, service)
    reshard.execute_reshard_plan(plan, src, dst, service)
    with pytest.raises(reshard.ReshardError, match="strict=False"):
        reshard.execute_reshard_plan(plan, src, extra, service)  # added after a refit
    for tensor in src.values():
        tensor.data[...] = 7
    reshard.execute_reshard_plan(plan, src, extra, service, strict=False)
    reshard.bind(plan, src, extra, service, strict=False).run()
    for name in src:
        np.testing.assert_array_equal(dst[name].data, src[name].data)


def test_phases_reuse_one_receive_buffer(service):
    source = np.arange(4 * 256, dtype=np.uint8).reshape(4, 256)
    scratch = np.zeros(256, np.uint8)
    for phase in range(4):
        service.set_phase(phase)
        service.register_send(phase + 1, source, phase * 256, 256, 0)
        service.register_receive(phase + 1, scratch, 0, 256, 0)
    assert service.schedule().phases == 4 and service.phases == 4
    for phase in range(4):
        service.run_phase(phase)
        np.testing.assert_array_equal(scratch, source[phase])
    with pytest.raises(reshard.ReshardError, match="4 phase"):
        service.run_phase(4)


def test_an_object_that_is_no_transform_is_refused_naming_what_would_do(service):
    plan, src, dst = _one_pe_plan()
    with pytest.raises(TypeError, match="Megatron's hooks: should_transform, prepare_send"):
        reshard.execute_reshard_plan(plan, src, dst, service, transform=object())


def test_python_transform_returning_no_array_is_refused(service):
    plan, src, dst = _one_pe_plan()
    broken = _BrokenTransform(lambda s: ["not an array"], lambda s: [np.zeros(4, np.uint8)])
    with pytest.raises(reshard.ReshardError, match="not an array"):
        reshard.execute_reshard_plan(plan, src, dst, service, broken)


def test_python_transforms_disagreeing_on_buffers_are_refused(service):
    plan, src, dst = _one_pe_plan()
    broken = _BrokenTransform(lambda s: [np.zeros(8, np.uint8)],
                              lambda s: [np.zeros(8, np.uint8), np.zeros(8, np.uint8)])
    with pytest.raises(reshard.ReshardError, match="wire buffer") as error:
        reshard.execute_reshard_plan(plan, src, dst, service, broken)
    assert error.value.code == "validation"


def test_python_transform_errors_propagate(service):
    plan, src, dst = _one_pe_plan()

    def fail(slice):
        raise ValueError(f"no conversion for {slice.param}")

    with pytest.raises(ValueError, match="no conversion for"):
        reshard.execute_reshard_plan(plan, src, dst, service, _BrokenTransform(fail, fail))


@pytest.mark.quick
def test_tensor_of_the_wrong_shape_is_refused_naming_both_shapes(service):
    plan, src, dst = _one_pe_plan()
    param = next(p for p in plan.params if len(p.shape) == 2 and p.shape[0] != p.shape[1])
    rows, cols = param.shape
    values = np.arange(rows * cols, dtype=np.uint16)
    # The same bytes seen transposed: accepted before, it scrambled the parameter.
    src[param.name] = reshard.LocalTensor(values.reshape(cols, rows), dtype="bfloat16")
    with pytest.raises(reshard.ReshardError) as error:
        reshard.execute_reshard_plan(plan, src, dst, service)
    text = str(error.value)
    assert f"source tensor '{param.name}' on PE 0 has shape [{cols}, {rows}]" in text, text
    assert f"local shape is [{rows}, {cols}]" in text, text
    assert error.value.code == "invalid argument"

    src[param.name] = reshard.LocalTensor(values.reshape(rows, cols), dtype="bfloat16")
    dst[param.name] = reshard.LocalTensor(np.zeros((rows + 1, cols), np.uint16), dtype="bfloat16")
    with pytest.raises(reshard.ReshardError, match=rf"has shape \[{rows + 1}, {cols}\]"):
        reshard.execute_reshard_plan(plan, src, dst, service)

    dst[param.name] = reshard.LocalTensor(np.zeros((rows, cols), np.uint16), dtype="bfloat16")
    reshard.execute_reshard_plan(plan, src, dst, service)
    np.testing.assert_array_equal(dst[param.name].data, values.reshape(rows, cols))


@pytest.mark.skipif(not has_torch(), reason="needs PyTorch")
def test_torch_tensors_parameters_and_subclasses_refit_byte_for_byte(service):
    import torch

    class Marked(torch.Tensor):  # a subclass keeps its own __dlpack__
        pass

    plan, _, _ = _one_pe_plan()
    generator = torch.Generator().manual_seed(5)
    src, dst = {}, {}
    for i, p in enumerate(plan.params):
        values = torch.randn(p.shape, generator=generator).to(torch.bfloat16)
        # Parameters require gradients, which torch's own __dlpack__ refuses.
        src[p.name] = (torch.nn.Parameter(values), values, values.as_subclass(Marked))[i % 3]
        dst[p.name] = (torch.zeros_like(values), torch.nn.Parameter(torch.zeros_like(values)),
                       torch.zeros_like(values).as_subclass(Marked))[(i + 1) % 3]
    reshard.execute_reshard_plan(plan, src, dst, service)
    for name in src:
        assert torch.equal(dst[name].detach().view(torch.int16),
                           src[name].detach().view(torch.int16)), name


def test_entries_that_are_no_arrays_are_refused_naming_the_tensor(service):
    plan, src, dst = _one_pe_plan()
    name = plan.params[0].name
    for side, value, message in (
            ("src", "weights", rf"source tensor '{name}': str is not an array reshard can read"),
            ("dst", 5, rf"destination tensor '{name}': int is not an array reshard can read"),
            ("dst", reshard.LocalTensor(np.zeros(plan.params[0].shape, np.uint16),
                                        dtype="bfloat16", scale="scales"),
             rf"destination tensor '{name}' \(scale\): str is not an array")):
        maps = {"src": dict(src), "dst": dict(dst)}
        maps[side][name] = value
        with pytest.raises(reshard.ReshardError, match=message) as refused:
            reshard.execute_reshard_plan(plan, maps["src"], maps["dst"], service)
        assert refused.value.code == "invalid argument"
    with pytest.raises(reshard.ReshardError, match="source tensors: the name 7 is not a string"):
        reshard.execute_reshard_plan(plan, {**src, 7: src[name]}, dst, service)
    frozen = np.zeros(plan.params[0].shape, np.uint16)
    frozen.flags.writeable = False
    with pytest.raises(reshard.ReshardError, match=rf"destination tensor '{name}' is read-only"):
        reshard.execute_reshard_plan(plan, src, {**dst, name: reshard.LocalTensor(
            frozen, dtype="bfloat16")}, service)


def readme_blocks(language):
    """The README's fenced code blocks in `language`, each as (heading above it, text)."""
    heading, blocks = "", []
    text = (HERE.parent.parent / "README.md").read_text()
    for match in re.finditer(rf"^(#+ [^\n]*)$|^```{language}\n(.*?)^```$", text, re.M | re.S):
        if match.group(1):
            heading = match.group(1)
        else:
            blocks.append((heading, match.group(2)))
    return blocks


@pytest.mark.quick
def test_the_readme_first_refit_runs_as_pasted(tmp_path):
    """The README's first Python program, saved and run as it says, checks every element."""
    [program] = [code for heading, code in readme_blocks("python") if "first refit" in heading]
    script = tmp_path / "refit.py"
    script.write_text(program)
    result = launch(4, script, timeout=120)
    assert_ok(result)
    assert result.stdout.count("every element as expected") == 4, result.stdout


def test_the_readme_snippets_are_python_and_the_examples_code():
    """Every Python block of the README compiles; its C++ block is a piece of the example the
    build compiles and the tests run (examples/ring_exchange.cpp), line for line."""
    python = readme_blocks("python")
    assert python
    for heading, code in python:
        compile(code, f"README.md ({heading})", "exec")
    example = (HERE.parent.parent / "examples" / "ring_exchange.cpp").read_text()
    example_lines = [line.strip() for line in example.splitlines()]
    [(heading, cpp)] = readme_blocks("cpp")
    lines = [line.strip() for line in cpp.splitlines()]
    start = example_lines.index(lines[0])
    assert example_lines[start:start + len(lines)] == lines, "README's C++ differs from the example"


def test_every_test_the_docs_cite_exists():
    """Docs name GoogleTest cases as `Suite.Name` and pytest ones as `test_...`: each must exist."""
    root = HERE.parent.parent
    sources = "\n".join(p.read_text() for p in (root / "tests").rglob("*.cpp"))
    python = "\n".join(p.read_text() for p in (root / "tests").rglob("*.py"))
    cited_gtest, cited_pytest = set(), set()
    for doc in [root / "README.md", *(root / "docs").glob("*.md")]:
        text = doc.read_text()
        cited_gtest |= {(doc.name, m.group(1), m.group(2)) for m in
                        re.finditer(r"`(?:[A-Za-z]+/)?([A-Z][A-Za-z]+)\.([A-Z][A-Za-z]+)(?:/[a-z0-9_]+)?`",
                                    text)}
        cited_pytest |= {(doc.name, m.group(1)) for m in re.finditer(r"`(test_[a-z0-9_]+)`", text)}
    assert cited_gtest, "no test names found in the docs: the pattern is broken"
    missing = [f"{doc}: {suite}.{name}" for doc, suite, name in sorted(cited_gtest)
               if not re.search(rf"TEST(?:_[FP])?\({suite},\s*{name}\)", sources)]
    missing += [f"{doc}: {name}" for doc, name in sorted(cited_pytest)
                if f"def {name}(" not in python]
    assert not missing, "the docs cite tests that do not exist:\n" + "\n".join(missing)


def test_bench_plot_draws_the_records_it_is_given(tmp_path):
    """`reshard bench plot`'s script on recorded results: one chart per kind of record given."""
    pytest.importorskip("matplotlib")
    root = HERE.parent.parent
    sys.path.insert(0, str(root / "tools" / "bench"))
    try:
        import plot_results
    finally:
        sys.path.pop(0)
    results = root / "results"
    records = plot_results.load([results / "host-cpu-2cores.jsonl",
                                 results / "h100x1-convert.jsonl"])
    written = plot_results.plot_all(records, tmp_path)
    assert sorted(p.name for p in written) == ["convert_nvidia-h100-80gb-hbm3.png",
                                               "copy_host_4pes.png"]
    assert all(p.stat().st_size > 10_000 for p in written)
    # Colocated refits of two kinds of GPU: one chart each, not one of both.
    colocated = plot_results.load([results / "h100x1-colocated.jsonl",
                                   results / "h200x1-colocated.jsonl"])
    written = plot_results.plot_all(colocated, tmp_path / "colocated")
    assert sorted(p.name for p in written) == ["colocated_nvidia-h100-80gb-hbm3.png",
                                               "colocated_nvidia-h200.png"]
    # Refits: each workload's newest day of runs, the last of each wins, each beside the
    # baseline of its run; a day that measured one workload keeps the others' bars.
    refits = plot_results.load([results / "h200x4-refit.jsonl"])
    bars = plot_results.latest_refits(refits)
    llama = ("llama3-8b, 32 layers", "none")
    # PEs sharing GPUs (colocated, a hand-loop baseline) have charts of their own.
    alone = [r for r in refits if "date" in r and not r.get("colocated")]
    newest = max(r["date"] for r in alone if r["model"] == "llama3-8b" and r["transform"] == "none")
    runs = [r for r in alone if r.get("date") == newest and r["model"] == "llama3-8b"
            and r["transform"] == "none"]
    assert any(r.get("colocated") for r in refits)
    assert bars[(*llama, "cuda (auto)")] is [
        r for r in runs if r["transport"] == "cuda" and "engine" in r][-1]
    # The baseline of the last run that timed it, whichever transport that run timed.
    assert bars[(*llama, "nccl (same run)")]["median_s"] == [
        r["baseline_median_s"] for r in runs if r.get("baseline") == "nccl"][-1]
    assert bars[(*llama, "nccl (same run)")]["date"] == newest
    qwen = [r for r in alone if r["model"] == "qwen3-30b-a3b" and r["transform"] == "none"]
    assert {r.get("date") for k, r in bars.items()
            if k[0].startswith("qwen3") and k[1] == "none"} == {max(r["date"] for r in qwen)}
    assert max(r["date"] for r in alone) == max(r.get("date", "") for r in bars.values())
    # Workloads last measured more than a day before the newest record are left out.
    last = datetime.date.fromisoformat(max(r["date"] for r in alone))
    assert all(last - datetime.date.fromisoformat(r["date"]) <= datetime.timedelta(days=1)
               for r in bars.values())
    assert any(last - datetime.date.fromisoformat(r["date"]) > datetime.timedelta(days=1)
               for r in alone)
    written = plot_results.plot_all(refits, tmp_path / "refits")
    # PEs sharing each of the 4 GPUs: a colocated chart of their own, apart from one GPU's.
    assert sorted(p.name for p in written) == ["colocated_4x-nvidia-h200.png",
                                               "refit_4x-nvidia-h200.png"]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert plot_results.main([str(empty), "--out", str(tmp_path / "none")]) == 1


# ---- several processes, host transport ----

@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_copy_service_random_workloads(n):
    assert_ok(launch(n, WORKERS / "copy_service_worker.py", 11 * n))


@pytest.mark.parametrize("n", [2, 4])
def test_reshard_layout_changes_and_transforms(n):
    assert_ok(launch(n, WORKERS / "reshard_worker.py"))


@pytest.mark.parametrize("n", [2, 3, 4])  # 3: TP 3 splits the toy model's dims unevenly
def test_a_bound_refit_across_ranks_and_a_refusal_on_one_rank(n):
    result = launch(n, WORKERS / "bound_refit_worker.py")
    assert_ok(result)
    assert result.stdout.count(": ok") == n, result.stdout


@pytest.mark.parametrize("n", [2, 4])
def test_a_rerun_on_one_rank_while_the_others_execute_fails_in_bounded_time(n):
    timeout = 3
    result = launch(n, WORKERS / "rerun_mismatch_worker.py", timeout, timeout=120)
    ended = {int(m.group(1)): m.group(2)
             for m in re.finditer(r"rank (\d+): (.*)$", result.stdout, re.MULTILINE)}
    assert sorted(ended) == list(range(n)), result.stdout + result.stderr
    assert "returned" not in ended.values(), result.stdout
    code, _, rest = ended[0].partition(" after ")
    assert code == "timeout", ended[0]
    assert float(rest.split(" s: ")[0]) < timeout + 10, ended[0]
    assert "every PE must rerun the same refit together" in rest, ended[0]
    for rank in range(1, n):  # left waiting in the ranks' agreement, told that rank 0 went away
        assert ended[rank].startswith("peer failure"), ended[rank]


def test_example_refits_tp4_into_tp2():
    result = launch(4, EXAMPLES / "refit_tp4_to_tp2.py")
    assert_ok(result)
    assert "all elements match" in result.stdout


@pytest.mark.skipif(not has_torch(), reason="needs PyTorch")
def test_megatron_adapter_on_cpu_tensors():
    assert_ok(launch(3, WORKERS / "megatron_worker.py", "cpu"))


@pytest.mark.skipif(not has_torch(), reason="needs PyTorch")
@pytest.mark.parametrize("n", [2, 4])
def test_a_transform_written_for_megatron_runs_unchanged(n):
    assert_ok(launch(n, WORKERS / "megatron_transform_worker.py", "cpu"))


@pytest.mark.skipif(not has_torch(), reason="needs PyTorch")
@pytest.mark.parametrize("n", [2, 3])
def test_megatron_service_without_a_transport_moves_cpu_tensors_on_the_host_transport(n):
    result = launch(n, WORKERS / "megatron_transport_worker.py", "cpu")
    assert_ok(result)
    assert result.stdout.count("CPU tensors moved on the host transport") == n


@pytest.mark.skipif(not has_torch(), reason="needs PyTorch")
def test_megatron_service_refuses_cpu_and_other_tensors_in_one_refit_on_every_rank():
    result = launch(3, WORKERS / "megatron_transport_worker.py", "mixed", timeout=60)
    assert_ok(result)
    assert result.stdout.count("refused: ReshardCopyService: rank(s) 1, 2 hand over CPU") == 3


@pytest.mark.skipif(not has_torch(), reason="needs PyTorch")
def test_megatron_service_recovers_from_a_refused_refit():
    import torch
    from reshard.megatron import ReshardCopyService

    service = ReshardCopyService(transport="host")  # one PE, outside any launcher
    weights = [torch.arange(300, dtype=torch.float32) + i for i in range(3)]
    for refit in range(4):
        refused = refit == 1  # a tensor reshard cannot read: the refit is refused, named
        sent = weights[:2] + [torch.empty(400, device="meta")] if refused else weights
        received = [torch.zeros(t.shape) for t in sent]
        for i, (w, r) in enumerate(zip(sent, received)):
            service.submit_send(w, 0, task_id=i)
            service.submit_recv(r, 0, task_id=i)
        if refused:
            with pytest.raises(reshard.ReshardError, match="the tensor sent to rank 0 under "
                               "task id 2: .*send buffer of task 512: torch.Tensor is not an "
                               "array reshard can read"):
                service.run()
            continue
        service.run()  # forgot the refused refit's submissions, planned again
        assert all(torch.equal(w, r) for w, r in zip(weights, received)), refit
    assert service.schedules == 2
    service.close()


def test_the_transport_for_a_refit_follows_its_tensors_devices():
    from reshard.megatron import transport_for_tensor_devices as choose

    assert choose([["cpu"], ["cpu"], []]) == "host"
    assert choose([["cuda"], [], ["cuda"]]) == "auto"
    assert choose([[], []]) == "auto"
    for mixed, named in (([["cpu"], ["cuda"]], "rank 1: cuda"),
                         ([["cpu", "cuda"], []], "rank 0: cuda")):
        with pytest.raises(reshard.ReshardError, match=re.escape(named)) as refused:
            choose(mixed)
        assert "rank(s) 0 hand over CPU tensors" in str(refused.value)


def has_megatron() -> bool:
    try:
        import megatron.core.resharding.refit  # noqa: F401
    except Exception:
        return False
    return True


MEGATRON_TESTS = ROOT.parent / "shared" / "megatron-tests"


def megatron_suite_outcomes(stdout):
    """{(layout, backend): outcome} from rank 0's report of Megatron's test_model_swap.py."""
    found = {}
    for outcome, layout, backend in re.findall(
            r"\[rank 0\] (PASSED|FAILED|XFAIL|XPASS|SKIPPED|ERROR) \S*test_swap_gpt_parametrized"
            r"\[([0-9None-]+)-(gloo|reshard|nvshmem|moves-nothing|nccl)\]", stdout):
        found[(layout, backend)] = outcome
    return found


@pytest.mark.skipif(not has_megatron(), reason="needs megatron-core (and PyTorch)")
@pytest.mark.parametrize("ranks", [4, 8])
@pytest.mark.parametrize("tag", ["core_v0.16.1", "core_v0.19.0"])
def test_megatron_own_model_swap_suite_with_reshard_services(tag, ranks):
    # Megatron-LM's own tests/unit_tests/resharding/test_model_swap.py, unchanged, at the
    # release tag of the installed megatron-core, on 4 and 8 ranks (layouts of up to 8 ranks run
    # only there; 3.5 min on 2 cores): reshard's ReshardCopyService and
    # Megatron's NVSHMEMCopyService over reshard's RemoteCopyService must pass every layout
    # Megatron's Gloo service passes, and a service that moves nothing must fail every one.
    import megatron.core
    folder = MEGATRON_TESTS / tag
    if not folder.is_dir():
        pytest.skip(f"Megatron's tests at {tag} are not at {MEGATRON_TESTS}")
    wanted = tag.removeprefix("core_v").rsplit(".", 1)[0]
    if not megatron.core.__version__.startswith(wanted + "."):
        pytest.skip(f"megatron-core {megatron.core.__version__} is installed; the tests of {tag} "
                    f"need {wanted}.x (PyPI here has no other)")
    result = launch(ranks, ROOT / "tests" / "megatron" / "run_model_swap.py", folder, timeout=1500,
                    RESHARD_TIMEOUT_S="60")
    outcomes = megatron_suite_outcomes(result.stdout)
    passed = {layout for (layout, backend), o in outcomes.items()
              if backend == "gloo" and o == "PASSED"}
    assert len(passed) >= 5, result.stdout[-4000:] + result.stderr[-4000:]
    for backend in ("reshard", "nvshmem"):
        mine = {layout for (layout, b), o in outcomes.items() if b == backend and o == "PASSED"}
        assert mine == passed, (backend, sorted(passed - mine), sorted(mine - passed))
    controls = {layout: o for (layout, b), o in outcomes.items() if b == "moves-nothing"}
    assert set(controls) >= passed and all(o in ("XFAIL", "SKIPPED") for o in controls.values()), \
        controls
    assert_ok(result)


# (source TP, PP, destination TP, PP) on 4 ranks: TP and PP changes, both, either way.
MEGATRON_LAYOUT_CHANGES = ["2 1 1 1", "1 1 2 1", "2 1 4 1", "1 2 1 1", "2 2 1 1", "1 1 2 2",
                           "2 1 1 2"]


@pytest.mark.skipif(not has_megatron(), reason="needs megatron-core (and PyTorch)")
@pytest.mark.parametrize("change", MEGATRON_LAYOUT_CHANGES)
def test_megatron_swap_model_weights_through_reshard_matches_its_gloo_service(change):
    result = launch(4, WORKERS / "megatron_refit_worker.py", *change.split(), timeout=300)
    assert_ok(result)
    assert "bitwise equal to Megatron's Gloo service, planned once" in result.stdout


@pytest.mark.skipif(not has_megatron(), reason="needs megatron-core (and PyTorch)")
def test_megatron_refit_a_rank_comes_late_to_is_given_up_alike_and_run_again():
    # The last rank comes to the second refit 9 s late; reshard's service waits 6 s for a rank
    # that has not come: every rank's swap_model_weights fails alike (retryable, naming the rank;
    # the late one's when it comes), each calls it again, and every refit is still bitwise
    # Megatron's Gloo service's, planned once.
    result = launch(4, WORKERS / "megatron_refit_worker.py", "2", "1", "1", "2", "3", "cpu",
                    "late=1", timeout=300)
    assert_ok(result)
    assert "bitwise equal to Megatron's Gloo service, planned once" in result.stdout


@pytest.mark.skipif(not has_megatron(), reason="needs megatron-core (and PyTorch)")
@pytest.mark.parametrize("change", ["2 1 1 2 3 cpu late=1 staged=1", "1 2 2 1 2 cpu staged=1"])
def test_megatron_staged_swap_writes_the_engine_model_only_at_commit(change):
    # reshard.megatron.StagedSwap over Megatron's own swap_model_weights: after every stage()
    # (and after one given up on a late rank) the destination still holds its old values; commit()
    # makes it bitwise Megatron's Gloo service's refit and advances the version; a second
    # commit() is refused.
    result = launch(4, WORKERS / "megatron_refit_worker.py", *change.split(), timeout=300)
    assert_ok(result)
    assert "bitwise equal to Megatron's Gloo service, planned once" in result.stdout
    assert ", staged then committed" in result.stdout


def test_megatron_staged_swap_refuses_a_transform_and_a_commit_with_nothing_staged():
    torch = pytest.importorskip("torch")
    from reshard import InvalidArgumentError, InvalidStateError
    from reshard.megatron import StagedSwap

    model = torch.nn.Linear(4, 3)
    before = [p.detach().clone() for p in model.parameters()]
    staged = StagedSwap(model)
    assert staged.staged_bytes == 4 * (4 * 3 + 3)
    assert staged.version == 0 and not staged.staged
    with pytest.raises(InvalidStateError, match="nothing is staged"):
        staged.commit()
    with pytest.raises(InvalidArgumentError, match="transform"):
        staged.stage(model, refit_method=None, transform=object())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert staged.version == 0


@pytest.mark.parametrize("n", [2, 3, 4])
def test_vocabularies_padded_differently_move_only_their_real_rows(n):
    result = launch(n, WORKERS / "padded_vocab_worker.py")
    assert_ok(result)
    assert result.stdout.count(": ok (source ParamSpec('embed.weight'") == n, result.stdout


# Mixture-of-experts GPTs (Megatron's local spec: router, SequentialMLP experts, a shared expert)
# on 4 ranks: TP changes of the experts' matrices, PP into TP, and expert parallelism 2 -> 4 (at
# megatron-core 0.16.1 Megatron's plan matches SequentialMLP experts by their local names under
# EP; see the worker), each bitwise equal to Megatron's Gloo service.
MEGATRON_MOE_CHANGES = ["2 1 1 1 experts=4 shared=1", "1 1 2 1 experts=4",
                        "1 2 2 1 experts=4 shared=1", "1 1 1 1 experts=4 src_ep=2 dst_ep=4"]


@pytest.mark.skipif(not has_megatron(), reason="needs megatron-core (and PyTorch)")
@pytest.mark.parametrize("change", MEGATRON_MOE_CHANGES)
def test_megatron_moe_swap_model_weights_through_reshard_matches_its_gloo_service(change):
    layout, options = change.split()[:4], change.split()[4:]
    result = launch(4, WORKERS / "megatron_refit_worker.py", *layout, 3, "cpu", *options,
                    timeout=300)
    assert_ok(result)
    assert "experts, EP" in result.stdout
    assert "bitwise equal to Megatron's Gloo service, planned once" in result.stdout


def test_remote_copy_service_takes_the_seed_api_by_its_keywords():
    from reshard.megatron import RemoteCopyService

    svc = RemoteCopyService(transport="host")
    svc.init("WARN")
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    svc.register_send(task_id=7, src_tensor=src, src_pos=8, size=16, dest_pe=0)
    svc.register_receive(task_id=7, dest_tensor=dst, dest_pos=32, size=16, src_pe=0)
    # Megatron's services read the request lists (and skip schedule() where both are empty).
    assert [(r.task_id, r.size, r.peer) for r in svc.send_requests] == [(7, 16, 0)]
    assert [(r.task_id, r.size, r.peer) for r in svc.receive_requests] == [(7, 16, 0)]
    svc.schedule()
    svc.run()
    np.testing.assert_array_equal(dst[32:48], src[8:24])
    assert not dst[:32].any() and not dst[48:].any()
    svc.clear_requests()
    assert svc.send_requests == [] and svc.receive_requests == []
    svc.finalize()
    with pytest.raises(RuntimeError, match=r"group=\.\.\.\) needs torch.distributed"):
        RemoteCopyService(transport="host", group=object())


def test_a_late_pe_has_the_arrival_timeout_and_a_schedule_or_run_it_missed_can_be_retried():
    # RESHARD_*TIMEOUT_S are 20 here; the service's own settings (1 s, 4 s) must be the ones used.
    result = launch(2, WORKERS / "late_arrival_worker.py", timeout=90, RESHARD_TIMEOUT_S="20")
    assert_ok(result)
    assert result.stdout.count(": ok") == 2, result.stdout


def test_a_late_rank_has_the_arrival_timeout_to_bind_update_and_execute_a_refit():
    # The first collective of bind(), update() and execute_reshard_plan is where ranks meet: a
    # rank later than the transfer timeout is waited for; one later than the arrival timeout is
    # named on every rank, and the bind retried works.
    result = launch(2, WORKERS / "late_bind_worker.py", timeout=90, RESHARD_TIMEOUT_S="20")
    assert_ok(result)
    assert result.stdout.count(": ok") == 2, result.stdout


def test_bootstrap_from_an_address_and_gil_released():
    port = __import__("reshard.launch", fromlist=["_free_port"])._free_port()
    assert_ok(launch(3, WORKERS / "bootstrap_worker.py", "address", port))


@pytest.mark.skipif(not has_torch(), reason="needs PyTorch")
def test_bootstrap_from_a_torch_process_group():
    assert_ok(launch(2, WORKERS / "bootstrap_worker.py", "torch"))
    assert_ok(launch(2, WORKERS / "bootstrap_worker.py", "megatron"))


def has_mpi4py() -> bool:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return shutil.which("mpirun") is not None


@pytest.mark.skipif(not has_mpi4py(), reason="needs mpi4py and mpirun")
def test_bootstrap_from_an_mpi4py_communicator():
    env = dict(os.environ, PYTHONPATH=str(Path(reshard.__file__).parent.parent))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    result = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", "2",
                             "-x", "PYTHONPATH", sys.executable,
                             str(WORKERS / "bootstrap_worker.py"), "mpi"],
                            env=env, capture_output=True, text=True, timeout=120 * TIME_SCALE)
    assert_ok(result)


def test_launch_stops_the_job_when_a_rank_fails(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['RANK'] == '1': sys.exit(3)\n"
                      "time.sleep(120)\n")
    start = time.monotonic()
    result = launch(3, script, timeout=60)
    assert result.returncode == 3
    assert time.monotonic() - start < 30
    assert "rank 1 exited with status 3" in result.stderr


def test_launch_names_the_rank_that_failed_first_and_prefixes_lines(tmp_path):
    # Rank 1 fails; the others fail as soon as it is gone (as peers that notice a dead rank do),
    # with another status. The launcher must name rank 1, not the lowest rank that failed.
    script = tmp_path / "cascade.py"
    script.write_text(
        "import os, pathlib, sys, time\n"
        f"marker = pathlib.Path({str(tmp_path)!r}) / 'pid'\n"
        "print('started', flush=True)\n"
        "if os.environ['RANK'] == '1':\n"
        "    marker.write_text(str(os.getpid())); time.sleep(0.3); sys.exit(2)\n"
        "while not marker.exists(): time.sleep(0.01)\n"
        "pid = int(marker.read_text() or 0)\n"
        "while True:\n"
        "    try: os.kill(pid, 0)\n"
        "    except ProcessLookupError: sys.exit(5)\n"
        "    time.sleep(0.005)\n")
    for _ in range(3):
        (tmp_path / "pid").unlink(missing_ok=True)
        result = launch(3, script, timeout=60)
        assert result.returncode == 2, result.stderr
        assert "rank 1 exited with status 2" in result.stderr
        assert "rank 0 exited" not in result.stderr and "rank 2 exited" not in result.stderr
        assert sorted(line for line in result.stdout.splitlines() if "started" in line) == [
            "[rank 0] started", "[rank 1] started", "[rank 2] started"]


@pytest.mark.parametrize("blocked_in", ["init", "run"])
def test_ctrl_c_stops_a_call_blocked_on_a_peer_with_keyboard_interrupt(tmp_path, blocked_in):
    """Ctrl-C (SIGINT) while a call waits for a peer that never comes raises KeyboardInterrupt at
    once, not at the timeout (60 s here), and the process exits with it."""
    import signal
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    script = tmp_path / "blocked.py"
    # "init": rank 0 of 2 waits for rank 1 to join; "run": a job of 2 whose rank 1 never calls
    # run() (it sleeps), so rank 0's run waits for its bytes.
    script.write_text(f"""
import os, sys, time
import numpy as np
import reshard
def waiting():
    open(r"{tmp_path / 'waiting.pid'}", "w").write(str(os.getpid()))
    print("waiting", flush=True)
if "{blocked_in}" == "init":
    waiting()
    reshard.CopyService("host", bootstrap="127.0.0.1:{port}", rank=0, world_size=2).init("WARN")
else:
    svc = reshard.CopyService("host").init("WARN")
    me = svc.my_pe
    src = np.ones(1 << 16, np.uint8); dst = np.zeros(1 << 16, np.uint8)
    svc.register_send(me, src, 0, src.nbytes, 1 - me)
    svc.register_receive(1 - me, dst, 0, dst.nbytes, 1 - me)
    svc.schedule()
    if me == 1:
        time.sleep(300)
    waiting()
    svc.run()
""")
    env = dict(os.environ, RESHARD_TIMEOUT_S="60", PYTHONPATH=os.pathsep.join(filter(None, [
        str(Path(reshard.__file__).parent.parent), os.environ.get("PYTHONPATH")])))
    if blocked_in == "init":
        command = [sys.executable, str(script)]
    else:
        command = [sys.executable, "-m", "reshard.launch", "-n", "2", str(script)]
    job = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, start_new_session=True)
    try:
        assert "waiting" in job.stdout.readline()
        time.sleep(1.5)  # well inside the call's wait
        start = time.monotonic()
        # Only the PE that waits (the launcher would pass a Ctrl-C on to every rank).
        os.kill(int((tmp_path / "waiting.pid").read_text()), signal.SIGINT)
        _, stderr = job.communicate(timeout=30 * TIME_SCALE)
        assert time.monotonic() - start < 10, "the interrupt waited for the timeout"
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode != 0
    assert "KeyboardInterrupt" in stderr and "interrupted (Ctrl-C)" in stderr, stderr


def test_launch_refuses_zero_processes_without_a_traceback():
    result = subprocess.run([sys.executable, "-m", "reshard.launch", "-n", "0", "x.py"],
                            capture_output=True, text=True, timeout=60 * TIME_SCALE)
    assert result.returncode == 2
    assert "must be at least 1" in result.stderr and "Traceback" not in result.stderr


def test_launch_stops_a_job_past_its_timeout(tmp_path):
    script = tmp_path / "slow.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(120)\n")
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "reshard.launch", "-n", "2", "--timeout", "2",
                             str(script)], capture_output=True, text=True, timeout=60 * TIME_SCALE)
    assert result.returncode == 124, result.stderr
    assert 2 <= time.monotonic() - start < 30
    assert "time limit of 2" in result.stderr
    assert sorted(result.stdout.splitlines()) == ["[rank 0] up", "[rank 1] up"]


def test_launch_from_python_takes_an_environment_and_refuses_what_cannot_start(tmp_path):
    from reshard.launch import launch as launch_job

    # Rank 1 fails, and the launcher then stops the other ranks: it waits for rank 0's file first
    # (written whole, by a rename), so a slow rank 0 is not stopped before it wrote it.
    script = tmp_path / "env.py"
    script.write_text("import os, pathlib, sys, time\n"
                      f"here = pathlib.Path({str(tmp_path)!r})\n"
                      "rank = int(os.environ['RANK'])\n"
                      "(here / f'part{rank}').write_text("
                      "os.environ['CHOSEN'] + ' ' + os.environ['WORLD_SIZE'])\n"
                      "os.replace(here / f'part{rank}', here / f'r{rank}')\n"
                      "deadline = time.monotonic() + 60\n"
                      "while rank and not (here / 'r0').exists() and time.monotonic() < deadline:\n"
                      "    time.sleep(0.01)\n"
                      "sys.exit(rank * 7)\n")
    env = dict(os.environ, CHOSEN="yes", RANK="99")  # the launcher's RANK wins
    assert launch_job([sys.executable, str(script)], 2, env=env) == 7
    assert (tmp_path / "r0").read_text() == "yes 2"
    assert (tmp_path / "r1").read_text() == "yes 2"
    with pytest.raises(reshard.ReshardError, match="cannot start '/nonexistent/program'"):
        launch_job(["/nonexistent/program"], 2)
    with pytest.raises(ValueError, match="nprocs"):
        launch_job([sys.executable, str(script)], 0)


def test_launch_gives_each_rank_torchrun_variables(tmp_path):
    script = tmp_path / "env.py"
    script.write_text("import os, pathlib\n"
                      "e = os.environ\n"
                      f"pathlib.Path({str(tmp_path)!r}, 'rank' + e['RANK']).write_text("
                      "' '.join([e['WORLD_SIZE'], e['LOCAL_RANK'], e['MASTER_ADDR'],"
                      " str(e['MASTER_PORT'].isdigit())]))\n")
    assert_ok(launch(2, script))
    assert (tmp_path / "rank0").read_text() == "2 0 127.0.0.1 True"
    assert (tmp_path / "rank1").read_text() == "2 1 127.0.0.1 True"


# ---- staged refits: stage while the engine serves, commit at once ----

@pytest.mark.parametrize("case,n", [("commit", 4), ("commit", 2), ("budget", 4), ("dead_peer", 4),
                                    ("dead_peer", 2), ("killed_in_stage", 2),
                                    ("killed_in_stage", 4)])
def test_staged_refit(case, n):
    # dead_peer / killed_in_stage: the last rank leaves before stage() / inside it; the others
    # must fail within the timeout (RESHARD_TIMEOUT_S=10), their destinations untouched.
    result = launch(n, WORKERS / "staged_refit_worker.py", case, timeout=180,
                    RESHARD_TIMEOUT_S="10")
    assert_ok(result)
    survivors = n - 1 if case in ("dead_peer", "killed_in_stage") else n
    assert result.stdout.count(f": ok {case}") == survivors, result.stdout


# ---- parts of a bound refit: groups run on their own ----

@pytest.mark.parametrize("n", [2, 3, 4])
def test_refit_groups_run_alone_write_only_their_parameters(n):
    result = launch(n, WORKERS / "refit_groups_worker.py", 10 + n, timeout=240)
    assert_ok(result)
    assert result.stdout.count(": ok") == n, result.stdout


# ---- PyTorch DTensor state dicts (reshard.torch), gloo ----

NO_TORCH = "needs PyTorch"


@pytest.mark.skipif(not has_torch(), reason=NO_TORCH)
@pytest.mark.parametrize("case,n,seed", [
    ("holdings", 4, 1), ("holdings", 6, 2),  # where every rank's elements are, against torch
    ("refits", 4, 1), ("refits", 6, 3),      # random meshes and placements, bitwise
    ("same_mesh", 4, 1),                     # against DTensor.redistribute; and across meshes
    ("fsdp", 4, 0),                          # fully_shard -> TP 2 x 2 with fused QKV, gate/up
    ("fsdp_tp", 4, 0),                       # FSDP2 over TP (_StridedShard), MXFP8 destinations
    ("group", 4, 0),                         # in a process group of ranks 1-3
    ("bad_input", 4, 0), ("bad_input", 2, 0),
    ("groups", 3, 0),                        # bind(groups=) over the destination names
    ("padded", 3, 0),                        # a vocabulary each side pads its own way
])
def test_torch_state_dicts(case, n, seed):
    result = launch(n, WORKERS / "dtensor_worker.py", case, seed, timeout=300)
    assert_ok(result)
    assert result.stdout.count(f": ok {case}") == n, result.stdout


@pytest.mark.skipif(not has_torch(), reason=NO_TORCH)
def test_torch_placements_are_torch_chunks():
    # One process: the arithmetic against torch.chunk on a tensor, uneven sizes included.
    import torch
    import reshard.torch as rt
    from reshard.torch.placements import placement_of

    for size in range(0, 13):
        for n in range(1, 6):
            g = torch.arange(size)
            for i in range(n):
                chunks = g.chunk(n) if size else ()
                want = chunks[i].tolist() if i < len(chunks) else []
                local_shape, pieces = rt.holdings([size], [n], [placement_of("S(0)", 1)], [i])
                got = [x for offset, extent, _ in pieces for x in range(offset[0],
                                                                      offset[0] + extent[0])]
                assert local_shape == [len(want)] and got == want, (size, n, i)
    with pytest.raises(ValueError, match="is not one of"):
        placement_of("Shard", 2)
    with pytest.raises(ValueError, match="shards dim 2 of a 2-dimensional tensor"):
        placement_of("S(2)", 2)


@pytest.mark.skipif(not has_torch(), reason=NO_TORCH)
def test_torch_bind_needs_a_process_group():
    import torch
    import reshard.torch as rt

    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        rt.bind({"w": torch.zeros(4)}, {"w": torch.zeros(4)})


@pytest.mark.skipif(not has_torch(), reason=NO_TORCH)
def test_torch_example_fsdp_to_tp():
    result = launch(4, EXAMPLES / "dtensor_fsdp_to_tp.py", timeout=240)
    assert_ok(result)
    assert result.stdout.count(": ok,") == 4, result.stdout


@pytest.mark.skipif(not has_torch(), reason=NO_TORCH)
def test_torch_dtensor_benchmark_runs_on_the_host():
    # The benchmark's CPU path (the GPU one adds the IPC copy loop and the copy ceiling): every
    # destination element checked.
    result = launch(4, Path(__file__).resolve().parents[2] / "tools" / "bench" /
                    "dtensor_refit_bench.py", "--device", "cpu", "--layers", "1", "--vocab",
                    "512", "--iters", "2", "--warmup", "1", timeout=300,
                    # Its barriers wait for the slowest rank's work between them: 20 s ran out
                    # on a 2-core machine loaded with other builds.
                    RESHARD_TIMEOUT_S="60")
    assert_ok(result)
    assert "wrong destination elements (slowest PE): reshard 0, copy loop 0" in result.stdout


# ---- GPUs (several PEs share a GPU where there are fewer GPUs than PEs; NCCL refuses that) ----

ONE_GPU = "needs PyTorch with a CUDA GPU"

@pytest.mark.skipif(gpu_count() < 1, reason=ONE_GPU)
@pytest.mark.parametrize("n", [2, 4])
def test_gpu_copy_service_random_workloads(n):
    assert_ok(launch(n, WORKERS / "copy_service_worker.py", 5 * n, "torch-cuda"))


@pytest.mark.skipif(gpu_count() < 1, reason=ONE_GPU)
@pytest.mark.parametrize("transport", ["nccl", "nvshmem"])
def test_gpu_copy_service_on_each_gpu_transport(transport):
    if transport not in reshard.available_transports():
        pytest.skip(f"this build has no {transport} transport")
    if transport == "nccl" and gpu_count() < 2:
        pytest.skip("NCCL needs a GPU per rank (it refuses two ranks on one GPU)")
    assert_ok(launch(2, WORKERS / "copy_service_worker.py", 9, "torch-cuda", transport))


def has_cupy_gpus(n) -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() >= n
    except Exception:
        return False


@pytest.mark.skipif(gpu_count() < 1, reason=ONE_GPU)
@pytest.mark.parametrize("n", [2, 4])
def test_gpu_refit_groups_run_alone_write_only_their_parameters(n):
    result = launch(n, WORKERS / "refit_groups_worker.py", 20 + n, "cuda", timeout=300)
    assert_ok(result)
    assert result.stdout.count(": ok") == n, result.stdout


@pytest.mark.skipif(gpu_count() < 1, reason=ONE_GPU)
def test_gpu_copies_far_apart_move_on_every_engine():
    # Equal copies GiBs apart merge into one descriptor of "rows" whose pitch is past what
    # cudaMemcpy2DAsync takes: the copy engine must move them row by row.
    result = launch(2, WORKERS / "far_apart_copies_worker.py")
    assert_ok(result)
    assert result.stdout.count(": ok") == 2, result.stdout


@pytest.mark.skipif(not has_cupy_gpus(1), reason="needs CuPy with a GPU")
def test_gpu_copy_service_with_cupy_arrays():
    assert_ok(launch(2, WORKERS / "copy_service_worker.py", 3, "cupy-cuda"))


@pytest.mark.skipif(gpu_count() < 1, reason=ONE_GPU)
def test_gpu_copy_service_with_expandable_segments():
    # PyTorch's expandable segments are virtual-memory allocations, which CUDA IPC cannot share:
    # the CUDA transport stages those destinations through its bounce buffer.
    assert_ok(launch(2, WORKERS / "copy_service_worker.py", 4, "torch-cuda",
                     PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"))


def jax_gpu_count() -> int:
    """GPUs JAX sees, asked in a child process so this one never initialises a GPU backend."""
    import importlib.util
    if importlib.util.find_spec("jax") is None or gpu_count() == 0:
        return 0
    probe = subprocess.run([sys.executable, "-c", "import jax; print(len(jax.devices('gpu')))"],
                           capture_output=True, text=True, timeout=120 * TIME_SCALE)
    return int(probe.stdout.strip() or 0) if probe.returncode == 0 else 0


@pytest.mark.skipif(jax_gpu_count() < 1, reason="needs JAX with a GPU")
def test_gpu_copy_service_with_jax_arrays():
    # XLA's allocator hands out pieces of one large allocation: the CUDA transport maps them
    # through CUDA IPC at their offset.
    assert_ok(launch(2, WORKERS / "copy_service_worker.py", 4, "jax-cuda",
                     XLA_PYTHON_CLIENT_PREALLOCATE="false"))


@pytest.mark.skipif(gpu_count() < 1 or not has_torch(), reason=ONE_GPU)
def test_gpu_runs_without_a_stream_wait_for_the_default_stream():
    # PyTorch writes on its default stream (handle 0); a run given none, or that one, must come
    # after those writes on every path: copy service and execute_reshard_plan.
    assert_ok(launch(2, WORKERS / "default_stream_worker.py"))


@pytest.mark.skipif(gpu_count() < 1 or not has_torch(), reason=ONE_GPU)
def test_gpu_bound_refit_follows_the_current_stream_and_replays_in_a_cuda_graph():
    # Writes on a non-default current stream just before a refit are read by it (bound run() and
    # execute_reshard_plan); an MXFP8 bound refit captured in torch.cuda.graph replays bit for
    # bit what a direct refit writes.
    result = launch(2, WORKERS / "bound_refit_gpu_worker.py")
    assert_ok(result)
    assert result.stdout.count(": ok") == 2, result.stdout
    print("".join(line + "\n" for line in result.stdout.splitlines() if "host time" in line))


@pytest.mark.skipif(gpu_count() < 1, reason=ONE_GPU)
def test_gpu_example_refits_tp4_into_tp2():
    result = launch(4, EXAMPLES / "refit_tp4_to_tp2.py", "--device", "cuda")
    assert_ok(result)


@pytest.mark.skipif(gpu_count() < 1, reason=ONE_GPU)
def test_gpu_megatron_adapter():
    assert_ok(launch(2, WORKERS / "megatron_worker.py", "cuda"))


@pytest.mark.skipif(gpu_count() < 1 or not has_megatron(),
                    reason="needs a GPU and megatron-core (with PyTorch)")
@pytest.mark.parametrize("change", MEGATRON_LAYOUT_CHANGES)
def test_gpu_megatron_swap_model_weights_on_the_cuda_transport(change):
    # Four ranks on the GPUs there are (all four on one GPU: colocated trainer and engine).
    result = launch(4, WORKERS / "megatron_refit_worker.py", *change.split(), 3, "cuda",
                    timeout=300)
    assert_ok(result)
    assert "on cuda: 3 refits bitwise equal to Megatron's Gloo service, planned once" in \
        result.stdout


def has_megatron_mxfp8_quantizer() -> bool:
    """Megatron's own MXFP8 quantizer (megatron-core >= 0.17, with Triton and a GPU)."""
    try:
        from megatron.core.inference.quantization import mxfp8_quantize
    except Exception:
        return False
    return gpu_count() >= 1 and mxfp8_quantize.HAVE_TRITON


@pytest.mark.skipif(not has_megatron_mxfp8_quantizer(),
                    reason="needs megatron-core >= 0.17 with Triton, and a GPU")
def test_gpu_megatron_mxfp8_preset_writes_megatrons_own_bytes():
    assert_ok(launch(2, WORKERS / "megatron_mxfp8_worker.py"))


@pytest.mark.skipif(not has_megatron_mxfp8_quantizer(),
                    reason="needs megatron-core >= 0.17 with Triton, and a GPU")
@pytest.mark.parametrize("change", ["2 1 1 1", "1 1 2 1", "2 1 4 1", "2 2 1 1"])
def test_gpu_megatron_mxfp8_reshard_transform_through_reshard(change):
    # Megatron's own MXFP8ReshardTransform (quantize on arrival into persistent MXFP8 buffers
    # with swizzled scales), driven by swap_model_weights, 4 ranks on the GPUs there are.
    result = launch(4, WORKERS / "megatron_refit_worker.py", *change.split(), 3, "cuda", "mxfp8",
                    timeout=300)
    assert_ok(result)
    assert "through MXFP8ReshardTransform: 3 refits bitwise equal to Megatron's Gloo service, " \
        "planned once" in result.stdout


def has_megatron_non_collocated() -> bool:
    """megatron-core >= 0.17: swap_model_weights takes None for a model a rank does not hold."""
    try:
        from megatron.core.resharding.refit import swap_model_weights
    except Exception:
        return False
    return "src_rank_offset" in __import__("inspect").signature(swap_model_weights).parameters


@pytest.mark.skipif(gpu_count() < 1 or not has_megatron_non_collocated(),
                    reason="needs a GPU and megatron-core >= 0.17 (non-collocated refits)")
@pytest.mark.parametrize("change, mode", [("2 1 1 1", "plain"), ("1 1 2 1", "plain"),
                                          ("1 2 2 1", "plain"), ("2 1 1 1", "mxfp8-send")])
def test_gpu_megatron_non_collocated_refit_through_reshard(change, mode):
    # The source on ranks 0-1, the destination on ranks 2-3 (trainer and engine apart), all
    # four processes on the GPUs there are.
    result = launch(4, WORKERS / "megatron_refit_worker.py", *change.split(), 3, "cuda", mode,
                    "apart", timeout=300)
    assert_ok(result)
    assert "non-collocated" in result.stdout and "3 refits bitwise equal" in result.stdout


@pytest.mark.skipif(gpu_count() < 1 or not has_megatron_mxfp8_quantizer(),
                    reason="needs megatron-core >= 0.17 with Triton, and a GPU")
@pytest.mark.parametrize("change", ["2 1 1 1", "1 1 2 1", "2 2 1 1"])
def test_gpu_megatron_mxfp8_transform_converting_on_send_through_reshard(change):
    # convert_on_send=True: data and scales, two tensors under one task id, collocated ranks
    # sending to themselves too.
    result = launch(4, WORKERS / "megatron_refit_worker.py", *change.split(), 3, "cuda",
                    "mxfp8-send", timeout=300)
    assert_ok(result)
    assert "through MXFP8ReshardTransform(convert_on_send=True): 3 refits bitwise equal" in \
        result.stdout


@pytest.mark.skipif(gpu_count() < 1, reason=ONE_GPU)
def test_gpu_a_transform_written_for_megatron_runs_unchanged():
    assert_ok(launch(2, WORKERS / "megatron_transform_worker.py", "cuda"))


@pytest.mark.skipif(gpu_count() < 1 or not has_torch(), reason=ONE_GPU)
@pytest.mark.parametrize("case,n", [("refits", 4), ("refits", 2), ("fsdp", 4), ("fsdp_tp", 4),
                                    ("same_mesh", 4), ("groups", 2)])
def test_gpu_torch_state_dicts(case, n):
    # CUDA tensors, PEs sharing the GPUs there are; the process group on gloo.
    result = launch(n, WORKERS / "dtensor_worker.py", case, 5, "cuda", timeout=300)
    assert_ok(result)
    assert result.stdout.count(f": ok {case}") == n, result.stdout


@pytest.mark.skipif(gpu_count() < 1 or not has_torch(), reason=ONE_GPU)
@pytest.mark.parametrize("case,n", [("commit", 2), ("commit", 4), ("dead_peer", 2),
                                    ("dead_peer", 4), ("killed_in_stage", 2),
                                    ("killed_in_stage", 4)])
def test_gpu_staged_refit(case, n):
    gone = case in ("dead_peer", "killed_in_stage")
    result = launch(n, WORKERS / "staged_refit_worker.py", case, "torch-cuda",
                    timeout=90 if gone else 240, RESHARD_TIMEOUT_S="10")
    assert_ok(result)
    survivors = n - 1 if gone else n
    assert result.stdout.count(f": ok {case}") == survivors, result.stdout
