"""pt.elastic for a compressor's state under pt.DataParallel: the residuals (and DGC's
momentum) each rank holds, committed with a copy on the next rank, and shared out
anew when the world changes.

Error feedback keeps on each rank what it has not sent yet; the all-reduce averages
what is sent, so what the ranks still owe the model is the mean of their residuals.
A rank that dies takes its residual with it unless someone holds a copy, so each
commit also sends every rank's state to the next rank (rank_copies.py). After a
change every rank starts from the mean over the old ranks (each from its owner, or
its buddy's copy if the owner died), as a checkpoint resumed at another size does
(checkpoint.py): what is owed is unchanged. What is the same on every rank
(PowerSGD's warm start, a generator's state, counts) comes from the new rank 0.
"""
import torch

from ..rank_copies import RankCopies


class Commits:
    """The commits of the compressor of a pt.DataParallel (``model.elastic_commits()``),
    driven by pt.elastic.State: ``snapshot``, ``replicate``, ``restore``, ``sync``."""

    def __init__(self, compressor, group_of):
        self.compressor, self.group_of = compressor, group_of   # group_of(): the wrapper's group now
        self.copies = RankCopies()
        self.shared = {}   # commit id -> the tensors that are the same on every rank (new rank 0's go out)

    def snapshot(self, commit_id):
        state = self.compressor.state_dict()
        tensors = sorted(k for k, v in state.items() if torch.is_tensor(v))
        mine = [k for k in tensors if k.split("/")[0] in self.compressor.PER_RANK]
        shared = [k for k in tensors if k not in mine]
        meta = {"mine": [[k, list(state[k].shape), _name(state[k].dtype)] for k in mine],
                "shared": [[k, list(state[k].shape), _name(state[k].dtype)] for k in shared],
                "values": {k: v for k, v in state.items() if not torch.is_tensor(v)}}
        group = self.group_of()
        self.copies.snapshot(commit_id, group.rank, group.world_size, [state[k] for k in mine], meta)
        self.shared = {commit_id: {k: state[k] for k in shared}, **{c: v for c, v in self.shared.items()
                                                                   if c in self.copies.kept}}

    def replicate(self, commit_id):
        self.copies.replicate(self.group_of(), commit_id)

    def restore(self, commit_id):
        """Nothing here: ``sync`` gives every rank the mean of the commit's states."""

    def sync(self, group, root, commit_id):
        shared = self.shared.get(commit_id, {})
        meta, brings, lost = self.copies.sources(group, root, commit_id)
        state = dict(meta["values"])
        sums = [torch.zeros(shape, dtype=torch.float64) for _, shape, _ in meta["mine"]]
        for tensors in brings.values():
            for total, t in zip(sums, tensors):
                total += t.to(torch.float64)
        for total in sums:
            group.all_reduce(total, op="sum")
        counted = meta["world"] - len(lost)
        if lost and group.rank == 0:
            print(f"paratrain: elastic: the compressor residuals of ranks {lost} are lost (each died with its "
                  f"neighbour between two commits); the others' mean is kept", flush=True)
        for (key, _, dtype), total in zip(meta["mine"], sums):
            state[key] = (total / max(counted, 1)).to(getattr(torch, dtype))
        for key, shape, dtype in meta["shared"]:   # the new rank 0's (a random generator's state, a warm start)
            t = shared[key].clone() if group.rank == root else torch.empty(shape, dtype=getattr(torch, dtype))
            group.broadcast(t, root)
            state[key] = t
        self.compressor.load_state_dict(state)
        self.snapshot(commit_id)   # this world's states, and their copies, from here on
        self.replicate(commit_id)


def _name(dtype):
    return str(dtype).removeprefix("torch.")
