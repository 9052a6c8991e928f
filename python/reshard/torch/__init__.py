"""reshard for PyTorch: refits between state dicts of DTensors (FSDP2, tensor parallel, both)
and tensors laid out over any other device mesh, in one ``torch.distributed`` world.

PyTorch cannot redistribute a DTensor to another mesh; this module binds such a refit once and
runs it at every step::

    import reshard.torch as rt

    # trainer ranks 0-1: FSDP2; engine ranks 2-3: TP 2 with fused QKV
    refit = rt.bind(trainer.state_dict() if training else None,
                    engine_weights if serving else None,
                    names={"qkv.weight": rt.Fused(["q.weight", "k.weight", "v.weight"])})
    refit.run()            # every step: only the bytes move

Values are DTensors, :class:`MeshShard` (a local tensor with a declared mesh and placements),
:class:`BoxShard` (explicit blocks) or plain tensors (whole parameters). torch is imported only
by this module; the rest of reshard works without it.
"""

from .placements import holdings, shard_order
from .state_dicts import BoxShard, Fused, MeshShard, StateDictRefit, bind

__all__ = ["BoxShard", "Fused", "MeshShard", "StateDictRefit", "bind", "holdings", "shard_order"]
