"""ElasticSampler: every sample of an epoch used exactly once, whatever the world does.

Each epoch is one permutation of the dataset (seeded by ``seed`` and the
epoch, the same on every rank). The world reads it from the front: with W
ranks, rank r takes every W-th index of what is left, starting at r, so
after k batches of B on every rank the world has used exactly the first
k x B x W indices of the permutation, a prefix. A commit keeps only that
prefix's length (``start``); after the world changes size, the new ranks
deal out the rest of the permutation the same way. Nothing is repeated,
unlike Horovod's ElasticSampler, which pads the epoch to a multiple of the
world size, and nothing is skipped, unlike torchft, whose data loader does
not resume (torchft #58).

The sampler counts the indices it has handed out; a DataLoader with
``num_workers=0`` asks for exactly the indices of the batches it makes, so
the count is what was consumed. A loader whose worker processes prefetch
asks for more: tell the sampler with ``record(n)`` how many this rank has
used.

Dealt one index at a time, the ranks' counts differ by one at most, and
when the epoch's last round holds fewer samples than there are ranks, some
ranks get one batch more than others (a synchronous step would then wait
for those that have none: ``pt.DataParallel``'s join handles uneven inputs).
With ``batch_size=B`` the sampler deals whole batches instead and is given
to the loader as ``DataLoader(dataset, batch_sampler=sampler)``: every rank
then gets the same number of batches, the last round split evenly, or,
where it holds fewer samples than ranks, added to the round before (a few
batches of B + 1).

With ``global_batch=G`` the world takes G samples a step whatever its size:
each step's G are the next G of the permutation, cut into W nearly equal
shares, rank by rank (``step_plan``). A job that must follow the same
trajectory of global batches when a worker is lost (each rank then weighs
its share's loss by its size) deals this way.
"""

import torch


class ElasticSampler(torch.utils.data.Sampler):
    def __init__(self, dataset, shuffle=True, seed=0, batch_size=None, rank=None, num_replicas=None,
                 global_batch=None):
        self.size = len(dataset)
        self.shuffle, self.seed = bool(shuffle), int(seed)
        self.batch_size, self.global_batch = batch_size, global_batch
        if batch_size is not None and global_batch is not None:
            raise ValueError("ElasticSampler: give batch_size (samples per rank) or global_batch (per step), not both")
        for name, value in (("batch_size", batch_size), ("global_batch", global_batch)):
            if value is not None and value < 1:
                raise ValueError(f"ElasticSampler: {name} must be at least 1, got {value}")
        if rank is None or num_replicas is None:
            from ..comm import world
            g = world()
            rank, num_replicas = g.rank if rank is None else rank, g.world_size if num_replicas is None else num_replicas
        self.epoch = 0
        self.start = 0          # indices of this epoch's permutation the world used before the last reset
        self.handed_out = 0     # indices this rank handed out since then
        self._recorded = None   # or what record() said this rank used
        self.reset(rank, num_replicas)

    # ---- the world -------------------------------------------------------------------------

    def reset(self, rank, num_replicas):
        """A new world (after a commit's restore): deal out the rest of the epoch anew."""
        if not 0 <= rank < num_replicas:
            raise ValueError(f"ElasticSampler: rank {rank} is not in a world of {num_replicas}")
        if self.global_batch is not None and self.global_batch < num_replicas:
            raise ValueError(f"ElasticSampler: a global batch of {self.global_batch} cannot give each of "
                             f"{num_replicas} ranks a sample; make it at least the world size")
        self.rank, self.num_replicas = int(rank), int(num_replicas)
        self.handed_out, self._recorded = 0, None

    def set_epoch(self, epoch):
        """Start epoch ``epoch`` from its first sample, unless it is the epoch already under
        way (a training function called again after a reset resumes it where the commit was)."""
        if epoch != self.epoch:
            self.epoch, self.start = int(epoch), 0
            self.handed_out, self._recorded = 0, None

    def record(self, n):
        """This rank has used ``n`` samples since the last reset (where a prefetching
        loader asked the sampler for more than it used)."""
        self._recorded = int(n)

    def used(self):
        """Samples of this epoch the whole world has used: those before the last reset,
        plus what every rank used in lockstep with this one: as many batches (with
        batch_size), or as many samples, capped at each rank's share (without: rank 0's
        share is the largest, so its count is the world's at the end of an uneven epoch)."""
        mine = self.handed_out if self._recorded is None else self._recorded
        if not self.batched:
            return min(self.size, self.start + self._taken(mine))
        plan = self._plan(self.size - self.start)
        sizes, k = plan[self.rank], 0
        while k < len(sizes) and sizes[k] and sum(sizes[:k + 1]) <= mine:
            k += 1   # whole batches this rank used; in lockstep every rank used as many
        return self.start + sum(sum(p[:k]) for p in plan)

    # ---- the commit ------------------------------------------------------------------------

    def state_dict(self):
        return {"epoch": self.epoch, "start": self.used(), "seed": self.seed, "size": self.size}

    def load_state_dict(self, state):
        if int(state["size"]) != self.size or int(state["seed"]) != self.seed:
            raise ValueError(f"ElasticSampler: the saved sampler was over {state['size']} samples with seed "
                             f"{state['seed']}, this one over {self.size} with seed {self.seed}")
        self.epoch, self.start = int(state["epoch"]), int(state["start"])
        self.handed_out, self._recorded = 0, None

    # ---- the indices -----------------------------------------------------------------------

    def permutation(self):
        """This epoch's order of the whole dataset, the same on every rank."""
        if not self.shuffle:
            return torch.arange(self.size)
        g = torch.Generator()
        g.manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.size, generator=g)

    @property
    def batched(self):
        """Dealt in batches (batch_size or global_batch): given to a loader as batch_sampler=."""
        return self.batch_size is not None or self.global_batch is not None

    def _plan(self, rest):
        """Each rank's batch sizes for the ``rest`` samples of the epoch."""
        if self.global_batch is not None:
            return step_plan(rest, self.num_replicas, self.global_batch)
        return batch_plan(rest, self.num_replicas, self.batch_size)

    def plan(self):
        """Batched: each rank's batch sizes for the rest of the epoch, [rank][batch]."""
        return self._plan(self.size - self.start)

    def _counts(self):
        """How many of the rest of the epoch each rank takes."""
        rest, w = self.size - self.start, self.num_replicas
        if not self.batched:
            return [len(range(r, rest, w)) for r in range(w)]
        return [sum(sizes) for sizes in self._plan(rest)]

    def _taken(self, mine):
        """The world's use when every rank has used ``mine`` (its own count, capped at its share)."""
        return sum(min(mine, n) for n in self._counts())

    def my_indices(self):
        """This rank's indices for the rest of the epoch, in the order it uses them."""
        if self.batched:
            return [i for batch in self.my_batches() for i in batch]
        return self.permutation()[self.start:].tolist()[self.rank::self.num_replicas]

    def my_batches(self):
        """Batched: this rank's batches for the rest of the epoch."""
        rest = self.permutation()[self.start:].tolist()
        plan = self._plan(len(rest))
        out, at = [], 0
        for k in range(max(map(len, plan))):   # round by round, rank by rank: each round a prefix of the rest
            for r, sizes in enumerate(plan):
                if k < len(sizes):
                    if r == self.rank:
                        out.append(rest[at:at + sizes[k]])
                    at += sizes[k]
        return out

    def __iter__(self):
        if not self.batched:
            for index in self.my_indices()[self.handed_out:]:
                self.handed_out += 1
                yield index
            return
        skip = self.handed_out
        for batch in self.my_batches():
            if skip >= len(batch):   # (a loader that stopped mid-epoch and asks again)
                skip -= len(batch)
                continue
            batch, skip = batch[skip:], 0
            self.handed_out += len(batch)
            yield batch

    def __len__(self):
        if not self.batched:
            return self._counts()[self.rank]
        return len(self._plan(self.size - self.start)[self.rank])


def batch_plan(rest, w, b):
    """The batch sizes of each of ``w`` ranks for the ``rest`` samples of an epoch, in
    batches of ``b``, every rank with the same number of batches: full rounds of b
    each, then the last partial round split evenly; where it holds fewer samples than
    ranks, they join the round before, one each to the first ranks (batches of b + 1).
    Fewer samples than ranks in all: one batch of one for the first ranks, none for
    the others (there is no even way)."""
    rounds, left = divmod(rest, w * b)
    plan = [[b] * rounds for _ in range(w)]
    if left and (left >= w or not rounds):
        for r in range(w):
            share = left // w + (1 if r < left % w else 0)
            if share:
                plan[r].append(share)
    elif left:
        for r in range(left):
            plan[r][-1] += 1
    return plan


def step_plan(rest, w, g):
    """The share of each of ``w`` ranks in each step of ``g`` samples over the ``rest``
    samples of an epoch: a step's g cut into w shares that differ by one at most. A
    last step of fewer than w samples joins the step before (one of g + left)."""
    steps, left = divmod(rest, g)
    sizes = [g] * steps
    if left and (left >= w or not steps):
        sizes.append(left)
    elif left:
        sizes[-1] += left
    return [[n // w + (1 if r < n % w else 0) for n in sizes] for r in range(w)]
