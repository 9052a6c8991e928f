"""A PyTorch trainer (FSDP2 on ranks 0-1) refits an inference engine (TP 2 on ranks 2-3, QKV and
gate/up fused as engines store them) with reshard.torch; every engine element is checked.

    python -m reshard.launch -n 4 examples/python/dtensor_fsdp_to_tp.py [--device cuda]

On one GPU the four ranks share it (the process group stays on gloo: NCCL refuses two ranks on
one GPU).
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

import reshard.torch as rt


class Block(torch.nn.Module):
    def __init__(self, hidden=256, kv=64, ffn=688):
        super().__init__()
        self.q = torch.nn.Linear(hidden, hidden, bias=False)
        self.k = torch.nn.Linear(hidden, kv, bias=False)
        self.v = torch.nn.Linear(hidden, kv, bias=False)
        self.o = torch.nn.Linear(hidden, hidden, bias=False)
        self.gate = torch.nn.Linear(hidden, ffn, bias=False)
        self.up = torch.nn.Linear(hidden, ffn, bias=False)
        self.down = torch.nn.Linear(ffn, hidden, bias=False)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    device = parser.parse_args().device
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    trainer, engine = [0, 1], [2, 3]

    # The trainer: a model sharded by FSDP2 (its state dict holds DTensors).
    trainer_weights = None
    if rank in trainer:
        torch.manual_seed(0)
        model = torch.nn.Sequential(Block(), Block()).to(torch.bfloat16).to(device)
        fully_shard(model, mesh=DeviceMesh(device, trainer))
        trainer_weights = model.state_dict()

    # The engine stores q, k, v as one qkv tensor and gate, up as one gate_up (the same mapping
    # on every rank), TP 2 over ranks 2-3, described by a mesh and placements.
    names = {}
    for i in range(2):
        names[f"{i}.qkv.weight"] = rt.Fused([f"{i}.q.weight", f"{i}.k.weight", f"{i}.v.weight"])
        names[f"{i}.gate_up.weight"] = rt.Fused([f"{i}.gate.weight", f"{i}.up.weight"])
    engine_weights = None
    if rank in engine:
        engine_weights = {}
        for i in range(2):
            for name, shape, placement in ((f"{i}.qkv.weight", ((256 + 64 + 64) // 2, 256), "S(0)"),
                                           (f"{i}.gate_up.weight", (688, 256), "S(0)"),
                                           (f"{i}.o.weight", (256, 128), "S(1)"),
                                           (f"{i}.down.weight", (256, 344), "S(1)")):
                local = torch.zeros(shape, dtype=torch.bfloat16, device=device)
                engine_weights[name] = rt.MeshShard(local, engine, [placement])

    # Once: every rank describes what it holds, all agree, plan, bind. Then run() each step.
    refit = rt.bind(trainer_weights, engine_weights, names=names)
    for step in range(3):
        if trainer_weights is not None:
            with torch.no_grad():
                for value in trainer_weights.values():
                    value.to_local().add_(1)  # the training step, in place
        refit.run()

    # Check: every engine shard against the trainer's full tensors.
    full = ({k: v.full_tensor().cpu() for k, v in trainer_weights.items()}
            if trainer_weights is not None else None)
    box = [full]
    dist.broadcast_object_list(box, src=0)
    full = box[0]
    if rank in engine:
        tp = engine.index(rank)
        for name, shard in engine_weights.items():
            target = names.get(name)
            parts = target.sources if isinstance(target, rt.Fused) else [name]
            dim = 1 if name.endswith(("o.weight", "down.weight")) else 0
            want = torch.cat([full[part].chunk(2, dim=dim)[tp] for part in parts], dim=0)
            assert torch.equal(shard.local.cpu(), want), f"rank {rank}: {name} differs"
    refit.close()
    print(f"rank {rank}: ok, {refit.plan.stats.total_bytes / 2**20:.1f} MiB a refit")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
