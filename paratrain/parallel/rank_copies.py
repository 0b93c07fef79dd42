"""Each rank's own state, committed in its memory and in its neighbour's: what pt.elastic
needs for state that differs between ranks (a ZeRO shard, a compressor's residuals).

A rank's commit keeps its tensors, and ``replicate`` sends them to rank (r + 1) mod W,
its buddy, in one ring shift (an isend and an irecv per rank), as Gemini keeps
in-memory checkpoint replicas on peers (Wang et al., SOSP 2023). After the world
changes, ``sources`` tells each rank which old ranks' tensors it is to bring: its own
if it lived, and the copy it holds of its old left neighbour if that one died; a
rank whose owner and buddy both died between two commits is lost. Two commits are
kept: a rank that died inside a commit leaves some ranks agreed on it and some
still on the one before (pt.elastic.State: the new rank 0's decides).
"""
import json

import torch

KEEP = 2


def ring_shift(group, tensors):
    """Send ``tensors`` to the next rank; returns the previous rank's, shaped alike
    (every rank's tensors have the same shapes)."""
    dtypes = {t.dtype for t in tensors}
    wire = dtypes.pop() if len(dtypes) == 1 else torch.float64   # one dtype: sent as it is
    out = torch.cat([t.reshape(-1).to(wire) for t in tensors]) if tensors else torch.zeros(0)
    into = torch.empty_like(out)
    if group.world_size > 1 and out.numel():
        recv = group.irecv(into, (group.rank - 1) % group.world_size)
        send = group.isend(out, (group.rank + 1) % group.world_size)
        send.wait()
        recv.wait()
    got, at = [], 0
    for t in tensors:
        got.append(into[at:at + t.numel()].view(t.shape).to(t.dtype))
        at += t.numel()
    return got


class RankCopies:
    """The commits of one rank's tensors and of its left neighbour's."""

    def __init__(self):
        self.kept = {}   # commit id -> {"rank", "world", "generation", "own", "buddy", "meta"}

    def snapshot(self, commit_id, rank, world, tensors, meta):
        """Keep copies of ``tensors`` (and ``meta``, JSON: what the rank 0 of a new world
        tells everyone) under ``commit_id``."""
        from ..comm.world import elastic_generation
        self.kept[commit_id] = {"rank": rank, "world": world, "generation": elastic_generation()[1],
                                "own": [t.detach().clone() for t in tensors], "buddy": None, "meta": meta}
        for old in sorted(self.kept)[:-KEEP]:
            del self.kept[old]

    def replicate(self, group, commit_id):
        """Send this commit's tensors to the next rank, keep the previous rank's (collective)."""
        mine = self.kept[commit_id]
        if group.world_size > 1:
            mine["buddy"] = ring_shift(group, mine["own"])

    def sources(self, group, root, commit_id):
        """After a change of the world (collective): (root's meta with the commit's old world
        size as ``meta["world"]``, {old rank: its tensors} for those this rank brings, the old
        ranks lost). A holder is a rank whose copy was taken in the commit's world (its size
        and generation); the caller then commits again, in the new world's layout."""
        from ..comm.world import broadcast_text
        kept = self.kept.get(commit_id)
        if group.rank == root and kept is None:
            raise RuntimeError(f"elastic: rank {root} leads the new world but holds no copy of commit {commit_id} "
                               f"(it holds {sorted(self.kept)})")
        said = json.dumps(dict(kept["meta"], world=kept["world"], generation=kept["generation"])) \
            if group.rank == root else None
        meta = json.loads(broadcast_text(group, said, root))
        old_world = meta["world"]
        # a holder's copy is of the commit's world: a joiner's own first commit is of another
        # (same id, taken in the world it joined), whatever its size
        ours = kept and kept["world"] == old_world and kept["generation"] == meta["generation"]
        mine = torch.tensor([kept["rank"] if ours else -1], dtype=torch.int64)
        table = torch.empty(group.world_size, dtype=torch.int64)
        group.all_gather(table, mine)
        held = {int(r): g for g, r in enumerate(table.tolist()) if r >= 0}
        brings, lost = {}, []
        for c in range(old_world):
            if c in held:
                holder, source = held[c], "own"
            elif (c + 1) % old_world in held and old_world > 1:
                holder, source = held[(c + 1) % old_world], "buddy"
            else:
                lost.append(c)
                continue
            if holder == group.rank:
                brings[c] = kept[source]
        return meta, brings, lost
