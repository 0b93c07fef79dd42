"""DistributedSampler: each worker its own disjoint shard of the data set.

This is torch's own ``torch.utils.data.DistributedSampler`` (shuffled per epoch
from a seed every rank shares, padded by repeating the first indices, or with
``drop_last`` trimmed, so that every rank gets the same number of samples),
taking the number of replicas and the rank from paratrain's world group
instead of from torch.distributed. Call ``set_epoch(e)`` at each epoch, as with
torch's, or every epoch repeats the same order.
"""
import torch.utils.data


class DistributedSampler(torch.utils.data.DistributedSampler):
    def __init__(self, dataset, num_replicas=None, rank=None, shuffle=True, seed=0, drop_last=False, group=None):
        if num_replicas is None or rank is None:
            from ..comm import world
            g = group or world()
            num_replicas = g.world_size if num_replicas is None else num_replicas
            rank = g.rank if rank is None else rank
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
