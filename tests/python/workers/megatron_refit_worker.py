"""One rank of Megatron-LM's own refit (``megatron.core.resharding``): two real GPTModels built on
the CPU with different tensor/pipeline parallelism, their weights moved by Megatron's
``swap_model_weights`` through Megatron's Gloo service and through reshard's
``ReshardCopyService`` in turn, over several refits with changing weights. Every destination
parameter must come out bitwise equal between the two (and written: none left zero), and reshard
must plan on the first refit only.

    megatron_refit_worker.py SRC_TP SRC_PP DST_TP DST_PP [REFITS] [cpu|cuda] [plain|mxfp8|mxfp8-send]
                             [together|apart] [experts=E src_ep=N dst_ep=N shared=1]

``experts=E``: a mixture-of-experts GPT (Megatron's local spec: a router and E experts per layer in
its ``SequentialMLP``, their matrices split by tensor parallelism as the dense ones are), with
``shared=1`` a shared expert beside them, and expert parallelism ``src_ep`` / ``dst_ep`` (default
1) on each side. Both services move what Megatron's plan says, and the check is the same: bitwise
equal to Megatron's Gloo service. (Megatron's refit at megatron-core 0.16.1 tells expert-parallel
parameters apart by ``allreduce=False``, which its ``SequentialMLP`` does not set, so under expert
parallelism its plan matches ``local_experts.i`` by that local name, whichever global expert a
rank holds there: a property of Megatron's plan, the same through either service.)

``late=1``: the last rank comes to reshard's second refit 9 s after the others, whose service waits
6 s for a rank that has not come (``arrival_timeout``): every rank's ``swap_model_weights`` fails
alike (the late rank's when it comes), ``retryable``, naming that rank; each calls it again, and the
refit is checked as every other one is.

``staged=1``: reshard's refits go through :class:`reshard.megatron.StagedSwap`: after each
``stage()`` (the late rank's retry included) every destination parameter must still hold what it
held before (zeros), and only ``commit()`` writes them and advances the version.

``together`` (collocated, the default): both models span every rank. ``apart`` (non-collocated,
megatron-core >= 0.17): the source lives on the first half of the ranks, the destination on the
second half, and each rank hands Megatron ``None`` for the model it does not hold.

With ``cuda`` both models live on the GPU (ranks share the GPUs there are, local rank modulo
their count) and reshard's service, made with no arguments, must pick its CUDA transport; Megatron's
Gloo service stages through the host as it always does. On a CPU-only PyTorch, Megatron's Gloo
service still asks for a CUDA stream: that one call gets a stand-in (None, which the service then
skips). The data path is Megatron's own.

With ``mxfp8`` (GPU, bf16 models) the refit goes through Megatron's own ``MXFP8ReshardTransform``
as its inference engine sets it up: the destination's decoder matrices land in persistent
``MXFP8Tensor`` buffers (data and swizzled 1-D scales), quantized on arrival; both services' buffers
must come out bitwise equal. Megatron quantizes with FlashInfer by default; where FlashInfer is not
installed its own Triton kernel (the other backend it ships) stands in, for both services alike.

With ``mxfp8-send`` the same transform runs with ``convert_on_send=True``: each sender quantizes its
slices and sends data and scales, two tensors under one task id, collocated too. Megatron allows
that mode only for 2-D (row-major) scales, which neither of its quantizers writes by default, and
its Gloo service cannot carry two tensors of one task id between a rank and itself; so the
quantizer is a small 2-D one of this file (on both sides alike) and the reference is that quantizer
applied to the bf16 weights Megatron's Gloo service delivers without a transform.
"""

import copy
import os
import sys
import time

import torch
import torch.distributed as dist

ARGS = [arg for arg in sys.argv[1:] if "=" not in arg]
OPTIONS = dict(arg.split("=", 1) for arg in sys.argv[1:] if "=" in arg)
DEVICE = ARGS[5] if len(ARGS) > 5 else "cpu"
MODE = ARGS[6] if len(ARGS) > 6 else "plain"
APART = len(ARGS) > 7 and ARGS[7] == "apart"
MXFP8 = MODE in ("mxfp8", "mxfp8-send")
EXPERTS = int(OPTIONS.get("experts", 0))
SRC_EP, DST_EP = int(OPTIONS.get("src_ep", 1)), int(OPTIONS.get("dst_ep", 1))
LATE = OPTIONS.get("late") == "1"
STAGED = OPTIONS.get("staged") == "1"
if DEVICE == "cpu":
    torch.cuda.Stream = lambda *args, **kwargs: None  # the stand-in (see above)
    # Megatron's router places its weights on the current CUDA device: here, the CPU.
    torch.cuda.current_device = lambda: torch.device("cpu")
if MXFP8:
    from megatron.core.inference.quantization import mxfp8_tensor
    from megatron.core.resharding.transforms import MXFP8ReshardTransform

    if MODE == "mxfp8-send":
        def _row_major_mxfp8(cls, x, group_size=32, backend=None):
            """E4M3 data and one E8M0 scale per 32 elements of a row, scales [M, K / 32]."""
            rows, cols = x.shape
            blocks = x.float().reshape(rows, cols // group_size, group_size)
            amax = blocks.abs().amax(-1)
            exponent = torch.ceil(torch.log2(amax / 448.0)).clamp(-127, 127)
            exponent = torch.where(amax > 0, exponent, torch.full_like(exponent, -127))
            data = (blocks / torch.exp2(exponent)[..., None]).clamp(-448, 448)
            return cls(data=data.reshape(rows, cols).to(torch.float8_e4m3fn),
                       scale=(exponent + 127).to(torch.uint8), backend="row-major")

        mxfp8_tensor.MXFP8Tensor.from_bf16 = classmethod(_row_major_mxfp8)
    elif not mxfp8_tensor.HAVE_FLASHINFER:  # Megatron's Triton backend stands in (see above)
        _from_bf16 = mxfp8_tensor.MXFP8Tensor.from_bf16.__func__
        mxfp8_tensor.MXFP8Tensor.from_bf16 = classmethod(
            lambda cls, x, group_size=32, backend="triton": _from_bf16(cls, x, group_size,
                                                                       backend))

from megatron.core.hyper_comm_grid import HyperCommGrid  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.resharding.copy_services.gloo_copy_service import GlooCopyService  # noqa
from megatron.core.resharding.refit import swap_model_weights  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from reshard import ReshardError  # noqa: E402
from reshard import InvalidStateError  # noqa: E402
from reshard.megatron import ReshardCopyService, StagedSwap  # noqa: E402


def process_groups(tp, pp, first, size, ep=1):
    """Megatron's process groups for a model of TP x EP x PP x DP on ranks first .. first + size - 1
    (DP fills them). Every rank takes part in making them, as torch.distributed requires."""
    dp = size // (tp * ep * pp)
    grid = HyperCommGrid([tp, 1, ep, pp, dp], ["tp", "cp", "ep", "pp", "dp"], rank_offset=first)
    tp_group, pp_group, dp_group = grid.create_pg("tp"), grid.create_pg("pp"), grid.create_pg("dp")
    # Embedding groups (first and last stage of each pipeline): every rank creates every one, in
    # the same order, as torch.distributed requires; the grid numbers TP fastest, then EP, PP, DP.
    embd = pos_embd = None
    for d in range(dp):
        for e in range(ep):
            for t in range(tp):
                stages = [first + t + tp * (e + ep * (p + pp * d)) for p in range(pp)]
                first_last = dist.new_group(ranks=sorted({stages[0], stages[-1]}))
                first_stage = dist.new_group(ranks=[stages[0]])
                if dist.get_rank() in stages:
                    embd, pos_embd = first_last, first_stage
    return ProcessGroupCollection(
        tp=tp_group, cp=grid.create_pg("cp"), pp=pp_group, ep=grid.create_pg("ep"),
        dp=dp_group, tp_cp=grid.create_pg(["tp", "cp"]), mp=grid.create_pg(["tp", "cp", "ep", "pp"]),
        expt_tp=tp_group, expt_dp=dp_group, tp_ep=grid.create_pg(["tp", "ep"]),
        tp_ep_pp=grid.create_pg(["tp", "ep", "pp"]), dp_cp=grid.create_pg(["cp", "dp"]),
        tp_dp_cp=grid.create_pg(["tp", "cp", "dp"]),
        embd=embd, pos_embd=pos_embd,
    )


def build_model(base, tp, pp, first=0, size=None, ep=1):
    """The model on ranks first .. first + size - 1 (all by default); None on the others."""
    size = dist.get_world_size() - first if size is None else size
    config = copy.deepcopy(base)
    config.tensor_model_parallel_size = tp
    config.pipeline_model_parallel_size = pp
    config.expert_model_parallel_size = ep
    groups = process_groups(tp, pp, first, size, ep)
    if not first <= dist.get_rank() < first + size:
        return None
    stage = dist.get_group_rank(groups.pp, dist.get_rank())
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS or None, moe_grouped_gemm=False)
    model = GPTModel(config=config, transformer_layer_spec=spec,
                     vocab_size=128, max_sequence_length=16, pre_process=stage == 0,
                     post_process=stage == pp - 1, share_embeddings_and_output_weights=False,
                     position_embedding_type="rope", pg_collection=groups)
    return model.to(DEVICE).eval()


def mxfp8_transform(model):
    """Megatron's MXFP8ReshardTransform over persistent buffers for the model's decoder matrices,
    as megatron.core.resharding.refit sets it up for an MXFP8 inference model."""
    buffers = {name: mxfp8_tensor.MXFP8Tensor.from_bf16(torch.zeros_like(param))
               for name, param in model.decoder.named_parameters()
               if param.dim() == 2 and param.shape[-1] % 32 == 0}
    transform = MXFP8ReshardTransform(convertible_params={f"decoder.{name}" for name in buffers},
                                      persistent_buffers=buffers, buffer_key_prefix="decoder.",
                                      convert_on_send=MODE == "mxfp8-send")
    return transform, buffers


def main():
    src_tp, src_pp, dst_tp, dst_pp = map(int, ARGS[:4])
    refits = int(ARGS[4]) if len(ARGS) > 4 else 3
    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    dist.init_process_group("gloo")
    me = dist.get_rank()
    torch.manual_seed(1234)
    dtype = torch.bfloat16 if MXFP8 else torch.float32
    moe = {}
    if EXPERTS:
        moe = dict(num_moe_experts=EXPERTS, moe_ffn_hidden_size=64, add_bias_linear=False,
                   moe_token_dispatcher_type="alltoall")
        if OPTIONS.get("shared") == "1":
            moe["moe_shared_expert_intermediate_size"] = 64
    base = TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=8,
                             num_query_groups=4, ffn_hidden_size=128, gated_linear_unit=True,
                             use_cpu_initialization=True, params_dtype=dtype,
                             pipeline_dtype=dtype, bf16=MXFP8, hidden_dropout=0.0,
                             attention_dropout=0.0, **moe)
    half = dist.get_world_size() // 2
    src_ranks, dst_ranks = ((0, half), (half, half)) if APART else ((0, None), (0, None))
    src = build_model(base, src_tp, src_pp, *src_ranks, ep=SRC_EP)
    dst_gloo = build_model(base, dst_tp, dst_pp, *dst_ranks, ep=DST_EP)
    dst_reshard = build_model(base, dst_tp, dst_pp, *dst_ranks, ep=DST_EP)
    holds_dst = dst_reshard is not None

    gloo = GlooCopyService()
    # Inside the torch.distributed job: no arguments needed.
    reshard_service = ReshardCopyService(**({"arrival_timeout": 6} if LATE else {}))
    late_rank, given_up = dist.get_world_size() - 1, 0
    transforms = {"gloo": (None, {}), "reshard": (None, {})}
    if MXFP8 and holds_dst:
        transforms = {"gloo": mxfp8_transform(dst_gloo), "reshard": mxfp8_transform(dst_reshard)}
    elif MXFP8:  # a pure sender: it converts the decoder's matrices it sends, holds no buffers
        names = {f"decoder.{name}" for name, param in src.decoder.named_parameters()
                 if param.dim() == 2}
        transforms = {"gloo": (None, {}), "reshard": (MXFP8ReshardTransform(
            names, {}, buffer_key_prefix="decoder.", convert_on_send=MODE == "mxfp8-send"), {})}
    failures = []
    staged = StagedSwap([dst_reshard] if holds_dst else None) if STAGED else None

    def reshard_swap(source, extra):
        if staged is not None:
            staged.stage(source, refit_method=reshard_service, **extra)
        else:
            swap_model_weights(source, [dst_reshard] if holds_dst else None,
                               refit_method=reshard_service, **extra)

    def unchanged_before_commit(refit, when):
        if not holds_dst:
            return
        written = [name for name, param in dst_reshard.named_parameters() if torch.any(param != 0)]
        if written:
            failures.append(f"refit {refit}: {when}, before commit(), {len(written)} destination "
                            f"parameters were written ({written[0]}, ...)")

    for refit in range(refits):
        with torch.no_grad():  # new weights every refit, as training makes them
            for i, (name, param) in enumerate(src.named_parameters() if src is not None else []):
                generator = torch.Generator().manual_seed(1000 * refit + 17 * me + i)
                param.copy_(torch.randn(param.shape, generator=generator))  # to the device too
            for model in (dst_gloo, dst_reshard) if holds_dst else ():
                for param in model.parameters():
                    param.zero_()
            for _, buffers in transforms.values():
                for buffer in buffers.values():
                    buffer.data.view(torch.uint8).zero_()
                    buffer.scale.view(torch.uint8).zero_()
        extra = {"transform": transforms["gloo"][0]} if MODE == "mxfp8" else {}
        source = [src] if src is not None else None
        swap_model_weights(source, [dst_gloo] if holds_dst else None, refit_method=gloo, **extra)
        extra = {"transform": transforms["reshard"][0]} if MXFP8 else {}
        if LATE and refit == 1 and me == late_rank:
            time.sleep(9)  # the others give this refit up at 6 s and wait again in their retry
        try:
            reshard_swap(source, extra)
        except ReshardError as error:
            text = str(error)
            if not (LATE and refit == 1 and error.retryable and
                    f"PE {late_rank} did not call ReshardCopyService.run() in time" in text):
                raise
            given_up += 1
            if staged is not None:
                unchanged_before_commit(refit, "after a stage() given up")
                if staged.staged:
                    failures.append(f"refit {refit}: a stage() given up counts as staged")
            reshard_swap(source, extra)
        if staged is not None:
            unchanged_before_commit(refit, "after stage()")
            if staged.version != refit or not staged.staged:
                failures.append(f"refit {refit}: version {staged.version} (staged: "
                                f"{staged.staged}) before commit()")
            staged.commit()
            if staged.version != refit + 1 or staged.staged:
                failures.append(f"refit {refit}: version {staged.version} after commit()")
            try:
                staged.commit()
                failures.append(f"refit {refit}: a second commit() was not refused")
            except InvalidStateError as error:
                if "nothing is staged" not in str(error):
                    failures.append(f"refit {refit}: commit() refused as {error}")
        if MODE == "mxfp8-send" and holds_dst:  # the reference: what Gloo delivered, quantized
            gloo_params = dict(dst_gloo.decoder.named_parameters())
            transforms["gloo"] = (None, {
                name: mxfp8_tensor.MXFP8Tensor.from_bf16(gloo_params[name].detach())
                for name in transforms["reshard"][1]})
        for name, a in transforms["gloo"][1].items():
            b = transforms["reshard"][1][name]
            for part in ("data", "scale"):
                mine = getattr(b, part).view(torch.uint8)
                theirs = getattr(a, part).view(torch.uint8)
                if not torch.equal(mine, theirs):
                    failures.append(f"refit {refit}: MXFP8 {part} of {name} differs from "
                                    "Megatron's Gloo service")
                if part == "data" and not torch.any(theirs != 0):
                    failures.append(f"refit {refit}: MXFP8 data of {name} was not written")
        if not holds_dst:
            continue
        for (name, a), (_, b) in zip(dst_gloo.named_parameters(), dst_reshard.named_parameters()):
            # A parameter that Megatron's MXFP8 transform takes lands in its buffers instead
            # (compared above); in mxfp8-send mode Gloo's refit has no transform.
            converted = name.startswith("decoder.") and name[8:] in transforms["reshard"][1]
            if not converted and not torch.equal(a, b):
                failures.append(f"refit {refit}: {name} differs from Megatron's Gloo service")
            gloo_converted = converted and MODE == "mxfp8"
            if refit == 0 and not gloo_converted and not torch.any(a != 0) and a.numel() > 0:
                failures.append(f"refit {refit}: {name} was not written by the Gloo service")
    expected = "cuda" if DEVICE == "cuda" else "host"
    if reshard_service.service.transport != expected:
        failures.append(f"reshard chose the {reshard_service.service.transport} transport, not "
                        f"{expected}")
    if DEVICE == "cuda" and holds_dst and not all(p.is_cuda for p in dst_reshard.parameters()):
        failures.append("the destination model left the GPU")
    if LATE and given_up != 1:
        failures.append(f"gave {given_up} refit(s) up waiting for rank {late_rank}")
    if reshard_service.schedules != 1:
        failures.append(f"reshard planned {reshard_service.schedules} times in {refits} refits")
    if not isinstance(reshard_service, __import__(
            "megatron.core.resharding.copy_services.base", fromlist=["CopyService"]).CopyService):
        failures.append("ReshardCopyService is not a Megatron CopyService")
    reshard_service.close()
    for failure in failures[:20]:
        print(f"rank {me}: {failure}", file=sys.stderr)
    ok = torch.tensor([0 if failures else 1])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if me == 0 and ok.item():
        moe = f" with {EXPERTS} experts, EP{SRC_EP} -> EP{DST_EP}" if EXPERTS else ""
        print(f"megatron refit TP{src_tp} PP{src_pp} -> TP{dst_tp} PP{dst_pp}{moe} on {DEVICE}"
              f"{', non-collocated' if APART else ''}"
              f"{' through MXFP8ReshardTransform' if MODE == 'mxfp8' else ''}"
              f"{' through MXFP8ReshardTransform(convert_on_send=True)' if MODE == 'mxfp8-send' else ''}"
              f"{', staged then committed' if STAGED else ''}"
              f": {refits} "
              "refits bitwise equal to Megatron's Gloo service, planned once")
    dist.destroy_process_group()
    return 0 if ok.item() else 1


if __name__ == "__main__":
    sys.exit(main())
