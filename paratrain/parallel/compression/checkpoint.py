"""A compressor's state in a checkpoint: every rank's, in one file.

Error feedback keeps on each rank what it has not sent yet (the residual),
and DGC's momentum correction each rank's own momentum; both differ between
ranks and are part of the training, so a run that resumes without them
applies a different update than the run that never stopped. ``gather``
collects every rank's ``state_dict()`` (collective: every rank calls it;
the checkpoint writer keeps the result), and ``restore`` gives each rank its
own back.

At another world size no rank's own state exists; what the residuals still
owe the model is their average over the ranks (each rank's share of the
averaged gradient), so every new rank starts from the old ranks' mean: the
update still owed is unchanged. The shared parts (PowerSGD's warm start,
step counts) are taken from rank 0.
"""
import torch


def gather(group, compressor):
    """{"kind", "world_size", "ranks": [each rank's state_dict()]}, on every rank. Tensors may
    differ in size between ranks (a tensor-parallel cut): each is sent padded to the largest."""
    mine = compressor.state_dict()
    ranks = [{} for _ in range(group.world_size)]
    for key in sorted(mine):
        value = mine[key]
        if not isinstance(value, torch.Tensor):
            for state in ranks:   # step counts: the same on every rank
                state[key] = value
            continue
        flat = value.contiguous().view(-1)
        sizes = torch.empty(group.world_size, dtype=torch.int64)
        group.all_gather(sizes, torch.tensor([flat.numel()], dtype=torch.int64))
        padded = torch.zeros(int(sizes.max()), dtype=flat.dtype)
        padded[:flat.numel()] = flat
        every = torch.empty(group.world_size * padded.numel(), dtype=flat.dtype).view(group.world_size, -1)
        group.all_gather(every, padded)
        for r, state in enumerate(ranks):
            # a copy of its own, not a view into ``every``: a view comes back from torch.load with
            # a storage offset, and Generator.set_state refuses it ("Invalid mt19937 state")
            got = every[r, :int(sizes[r])].clone()
            state[key] = got.view(value.shape) if int(sizes[r]) == flat.numel() else got
    return {"kind": type(compressor).__name__, "world_size": group.world_size, "ranks": ranks}


def restore(compressor, saved, rank, world_size):
    """Load ``gather``'s result into this rank's compressor: its own state at the world size it
    was saved at, else the mean of the ranks' (see the module's note). Returns a line for
    the log when the state could not be carried over as it was, else None."""
    kind = type(compressor).__name__
    if saved["kind"] != kind:
        raise ValueError(f"the checkpoint holds the state of a {saved['kind']} compressor, not of this run's "
                         f"{kind}: resume with the --compression it was written with")
    if saved["world_size"] == world_size:
        compressor.load_state_dict(saved["ranks"][rank])
        return None
    first, ranks = saved["ranks"][0], saved["ranks"]
    state = {}
    for key, value in first.items():
        if key.split("/")[0] in compressor.PER_RANK:
            shapes = {tuple(r[key].shape) for r in ranks}
            if len(shapes) > 1:
                raise ValueError(f"the compressor state {key!r} differs in shape between the checkpoint's "
                                 f"{saved['world_size']} workers (tensor-parallel cuts?): resume at "
                                 f"{saved['world_size']} workers")
            # summed in float64, as pt.elastic's re-form does (compression/elastic.py): the same
            # residuals whether a run resumed at another size or lost a worker
            state[key] = (sum(r[key].to(torch.float64) for r in ranks) / len(ranks)).to(first[key].dtype)
        else:
            state[key] = value
    compressor.load_state_dict(state)
    return (f"the compressor's residuals were saved by {saved['world_size']} workers: each of the "
            f"{world_size} starts from their mean (what they still owe the model is unchanged)")
