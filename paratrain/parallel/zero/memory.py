"""What a rank holds, measured: the bytes of the storages its tensors live in.

Counting storages rather than tensors counts what is allocated: views of one
flat buffer (ZeRO's parameters and chunks) count once, and a storage freed to
nothing (stage 3 between its gathers) counts zero. A DTensor (torch's FSDP2
and tensor parallelism) counts its local shard.
"""
import torch


def optimizer_tensors(opt):
    """The tensors of an optimizer's per-parameter state (Adam's moments, momentum, steps)."""
    return [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]


def held_bytes(parameters, gradients, optimizer_state):
    """{"parameters", "gradients", "optimizer": bytes}, each storage counted once over all three."""
    seen = set()

    def count(tensors):
        total = 0
        for t in tensors:
            if t is None:
                continue
            t = t.to_local() if hasattr(t, "to_local") else t
            storage = t.untyped_storage()
            key = storage.data_ptr(), storage.nbytes()
            if storage.nbytes() and key not in seen:
                seen.add(key)
                total += storage.nbytes()
        return total
    return {"parameters": count(parameters), "gradients": count(gradients), "optimizer": count(optimizer_state)}
