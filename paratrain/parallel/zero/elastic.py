"""pt.elastic for pt.ZeRO: each rank's shard committed in its memory and in its buddy's,
and re-cut for a new world from what the survivors hold.

    state = pt.elastic.State(model=engine, sampler=..., step=0)   # engine: a pt.ZeRO

Under ZeRO no rank holds the whole model or optimizer: rank r owns chunk r of every
unit (layout.py). A commit that kept only its own chunks would lose a dead rank's
for good, so each commit also sends them to the next rank (rank_copies.py). The loss
of any one rank, or of several that are not neighbours in the ring, loses nothing.

After a change of the world, every rank lays its engine out anew over the new world
(``ZeRO.regroup``: the same collectives a joining worker's constructor makes), then
``sync`` rebuilds each unit's whole vector of parameters and optimizer state: each
chunk comes from its owner if it lives, else from its buddy's copy, summed into
place by one all-reduce (a rank that holds nothing, a joiner, adds zeros), and the
new engine takes its chunks of it.
"""
import torch

from ..rank_copies import RankCopies


class ShardsLost(RuntimeError):
    """A chunk's owner and its buddy both died between two commits: its state is gone."""


class Commits:
    """The commits of one pt.ZeRO engine (``engine.elastic_commits()``), which
    pt.elastic.State drives: ``snapshot``, ``replicate``, ``restore``, ``sync``."""

    def __init__(self, engine):
        self.engine = engine
        self.copies = RankCopies()

    def snapshot(self, commit_id):
        """This rank's chunks (parameters, then each optimizer state tensor) and the rest of the
        optimizer's state (scalars, hyper-parameters), copied under ``commit_id``."""
        e = self.engine
        tensors, meta = _chunks(e)
        self.copies.snapshot(commit_id, e.rank, e.world_size, tensors, meta)

    def replicate(self, commit_id):
        """Send this commit's chunks to the next rank and keep the previous rank's (collective)."""
        self.copies.replicate(self.engine.group, commit_id)

    def restore(self, commit_id):
        """Nothing here: a rank's chunks alone do not make its parameters (below stage 3 each
        rank holds the whole model, gathered), so they come back in ``sync``, collectively."""

    def sync(self, group, root, commit_id):
        """Every rank's chunks of ``root``'s commit ``commit_id``, re-cut for ``group``."""
        meta, brings, lost = self.copies.sources(group, root, commit_id)
        old_world = meta["world"]
        if lost:
            c = lost[0]
            raise ShardsLost(f"ZeRO elastic: the shard of rank {c} is lost: it and the rank after it in the ring "
                             f"({(c + 1) % old_world}) both died between two commits; the run survives the loss "
                             "of any one rank, or of ranks that are not neighbours")
        e = self.engine
        whole = [torch.zeros(u.numel * (1 + len(meta["keys"][k])), dtype=torch.float32)
                 for k, u in enumerate(e.units)]
        for c, tensors in brings.items():
            _add_chunk(whole, e.units, tensors, meta, c, old_world)
        for w in whole:
            group.all_reduce(w, op="sum")
        _load(e, whole, meta)
        self.snapshot(commit_id)   # the chunks in this world's layout, and their copies, from here on
        self.replicate(commit_id)


def _chunks(e):
    """(tensors: each unit's parameter chunk then its optimizer tensors, in key order;
    meta: the keys, the scalars and the hyper-parameters, as JSON)."""
    sd = e.optimizer.state_dict()
    tensors, keys, scalars = [], [], []
    for k, u in enumerate(e.units):
        state = sd["state"].get(k, {})
        tensor_keys = sorted(key for key, v in state.items() if torch.is_tensor(v) and v.dim() == 1
                             and v.numel() == u.chunk)
        tensors.append(u.shard.detach())
        tensors += [state[key] for key in tensor_keys]
        keys.append(tensor_keys)
        scalars.append({key: float(v) for key, v in state.items() if key not in tensor_keys})
    group = {k: v for k, v in sd["param_groups"][0].items() if k != "params"}
    return tensors, {"keys": keys, "scalars": scalars, "group": group}


def _add_chunk(whole, units, tensors, meta, c, old_world):
    """Write old rank c's chunk of every unit (parameters, optimizer tensors) into place."""
    it = iter(tensors)
    for k, u in enumerate(units):
        chunk = -(-u.numel // old_world)
        lo, hi = c * chunk, min((c + 1) * chunk, u.numel)
        for j in range(1 + len(meta["keys"][k])):
            t = next(it)
            if hi > lo:
                whole[k][j * u.numel + lo:j * u.numel + hi] = t.reshape(-1)[:hi - lo]


def _load(e, whole, meta):
    """This rank's chunks of each unit's whole vectors into the engine: its shard (and,
    below stage 3, the model's parameters, which view the unit's flat buffer) and its
    optimizer's state."""
    state = {}
    with torch.no_grad():
        for k, u in enumerate(e.units):
            parts = whole[k].view(1 + len(meta["keys"][k]), u.numel)
            padded = torch.zeros(u.padded, dtype=u.shard.dtype)
            padded[:u.numel] = parts[0]
            u.shard.copy_(padded[e.rank * u.chunk:(e.rank + 1) * u.chunk])
            if e.stage < 3:
                u.flat.copy_(padded)
            state[k] = {key: torch.tensor(value) for key, value in meta["scalars"][k].items()}   # Adam's step
            for j, key in enumerate(meta["keys"][k], 1):
                padded = torch.zeros(u.padded, dtype=u.shard.dtype)
                padded[:u.numel] = parts[j]
                state[k][key] = padded[e.rank * u.chunk:(e.rank + 1) * u.chunk].clone()
            e.free(u)
    group = dict(meta["group"], params=list(range(len(e.units))))
    e.optimizer.load_state_dict({"state": {k: v for k, v in state.items() if v}, "param_groups": [group]})

