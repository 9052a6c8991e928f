"""reshard: fast, verifiable movement of tensor shards between processes and GPUs.

The copy service moves registered byte ranges between processes (``register_send`` /
``register_receive`` under task ids, ``schedule()`` once, ``run()`` every refit). The planner turns
two layouts of named parameters into transfer operations; ``bind`` binds a refit of a plan to a
rank's tensors once, and its ``run()`` then moves every weight into place at every refit,
optionally converting it on the way (casts, MXFP8, block FP8); ``execute_reshard_plan`` does the
same in one call per refit.

Tensors are passed as any DLPack or buffer-protocol object (PyTorch CPU/CUDA tensors, CuPy, NumPy,
JAX arrays); reshard reads and writes their memory in place and never copies them, so they must be
contiguous and must stay alive while registered.
"""

from __future__ import annotations

from ._core import (
    Layout,
    ModelParam,
    ModelSpec,
    Parallelism,
    ParamSpec,
    PlanStats,
    ReshardPlan,
    ReshardReport,
    ScaleTensor,
    ScheduleReport,
    TransferOp,
    available_transports,
    build_layout,
    component_versions,
    llama3_8b_model,
    make_cast_transform,
    make_fp8_block_transform,
    make_mxfp8_transform,
    make_reshard_plan,
    moe_1t_model,
    qwen3_30b_a3b_model,
    toy_model,
)
from .copy_service import CopyService, make_bootstrap, service_options, task_id
from .errors import (
    ErrorCode,
    IntegrityError,
    InvalidArgumentError,
    InvalidStateError,
    PeerFailureError,
    ReshardError,
    ReshardTimeoutError,
    ReshardTypeError,
    SystemCallError,
    UnsupportedError,
)
from .execution import execute_reshard_plan, rerun_reshard_plan
from .refit import BoundRefit, RefitGraph, bind
from .tensors import DLPackArray, LocalTensor
from .transforms import MegatronStyleTransform, ReshardTransform, SliceInfo

__version__ = "0.1.0"

__all__ = [
    "BoundRefit",
    "CopyService",
    "DLPackArray",
    "ErrorCode",
    "IntegrityError",
    "InvalidArgumentError",
    "InvalidStateError",
    "Layout",
    "LocalTensor",
    "MegatronStyleTransform",
    "ModelParam",
    "ModelSpec",
    "Parallelism",
    "ParamSpec",
    "PeerFailureError",
    "PlanStats",
    "RefitGraph",
    "ReshardError",
    "ReshardPlan",
    "ReshardReport",
    "ReshardTimeoutError",
    "ReshardTransform",
    "ReshardTypeError",
    "ScaleTensor",
    "ScheduleReport",
    "SliceInfo",
    "SystemCallError",
    "TransferOp",
    "UnsupportedError",
    "available_transports",
    "bind",
    "build_layout",
    "component_versions",
    "execute_reshard_plan",
    "llama3_8b_model",
    "make_bootstrap",
    "make_cast_transform",
    "make_fp8_block_transform",
    "make_mxfp8_transform",
    "make_reshard_plan",
    "moe_1t_model",
    "qwen3_30b_a3b_model",
    "rerun_reshard_plan",
    "service_options",
    "task_id",
    "toy_model",
]
