"""A group whose collectives move nothing, and a model cut over it: a worker's compute alone.

Timing a tensor-parallel worker, a ZeRO-3 engine or a compressor on this
host needs the work one rank of a real group does without its messages,
which the cost model prices on their own (here.py, stage_actions.py).
"""


class Done:
    """An asynchronous call of a ComputeOnlyGroup: made where it was issued, so done."""

    def wait(self):
        return None

    def is_completed(self):
        return True


class ComputeOnlyGroup:
    """Rank 0 of a group of ``world_size`` whose collectives move nothing: a model cut by
    pt.tensor.parallelize over it computes exactly what one rank of a real group computes
    (its shards of the matrices, the uncut embeddings, norms and loss whole), so timing
    it times a tensor-parallel worker's compute without its all-reduces, which
    tensor.py predicts on its own. The values are not a real group's (nothing is summed),
    the work is the same."""

    rank = 0

    def __init__(self, world_size):
        self.world_size = world_size

    def all_reduce(self, tensor, op="sum"):
        return tensor

    def broadcast(self, tensor, src=0):
        return tensor

    def all_gather(self, out, tensor, async_op=False):
        out.view(self.world_size, -1).copy_(tensor.reshape(1, -1).expand(self.world_size, -1))
        return Done() if async_op else out

    def reduce_scatter(self, out, tensor, op="sum"):
        out.reshape(-1).copy_(tensor.reshape(-1)[:out.numel()])
        return out


def cut_copy(task, tp):
    """A copy of ``task``'s model; with ``tp`` > 1 one worker's share of it, cut by its
    tensor plan (as paratrain train --tp cuts it) over a ComputeOnlyGroup."""
    import copy
    model = copy.deepcopy(task.model)
    if tp == 1:
        return model
    from ..parallel.tensor import parallelize
    return parallelize(model, group=ComputeOnlyGroup(tp), plan=task.tensor_plan(task.model))
