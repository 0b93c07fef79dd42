"""Worker: pt.ZeRO stages 1-3 step for step equal to pt.DataParallel, and the memory each holds.

Each rank trains on its own batches. The reference is pt.DataParallel with the
same optimizer on a copy of the same model; after every step every parameter
of the ZeRO model (gathered, for stage 3) must equal the reference's (1e-5
relative). The model has a parameter count no world size here divides (odd
widths), a layer that is never used, and a step with gradient clipping by the
global norm. Then the bytes ZeRO holds (measured: the storages allocated)
against the paper's formulas.
"""
import copy
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import paratrain as pt

TOL = 1e-5
LATE_S = 0.2   # rank 1 starts its second step this late (rank 0 would have to stall half of it to miss it)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(13, 31)
        self.norm = nn.LayerNorm(31)
        self.out = nn.Linear(31, 5)
        self.unused = nn.Linear(7, 3)   # never called: its gradients stay zero everywhere

    def forward(self, x):
        return self.out(F.gelu(self.norm(self.inp(x))))


def make_optimizer(kind):
    if kind == "adam":
        return torch.optim.Adam, dict(lr=1e-2)
    return torch.optim.SGD, dict(lr=0.1, momentum=0.9)


def batch(rank, k):
    gen = torch.Generator().manual_seed(100 * k + rank)
    return torch.randn(6, 13, generator=gen), torch.randint(0, 5, (6,), generator=gen)


def close(got, want, what):
    for k, b in want.items():
        a = got[k]
        err = float((a - b).abs().max())
        assert err <= TOL * max(1.0, float(b.abs().max())), f"{what}: {k} off by {err:.3e}"


def equal_to_data_parallel(g, stage, kind):
    torch.manual_seed(0)
    model = Net()
    ref_model = copy.deepcopy(model)
    cls, kw = make_optimizer(kind)
    engine = pt.ZeRO(model, cls, stage=stage, group=g, **kw)
    ref = pt.DataParallel(ref_model, group=g)
    ref_opt = cls(ref.parameters(), **kw)
    for k in range(4):
        x, y = batch(g.rank, k)
        if k == 1 and g.rank == 1 and stage >= 2:   # late: rank 0 waits for it in a collective: blocked
            time.sleep(LATE_S)
        blocked = engine.blocked_seconds()
        F.cross_entropy(engine(x), y).backward()
        F.cross_entropy(ref(x), y).backward()
        if k == 2:   # clipped by the norm of every rank's gradient chunks together
            norm = engine.clip_grad_norm_(0.05)
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
            assert abs(float(norm) - float(ref_norm)) <= 1e-5 * float(ref_norm), (float(norm), float(ref_norm))
        engine.step()
        if k == 1 and g.rank == 0 and stage >= 2:   # (stage 1 reduces in step(): DataParallel's backward waited)
            waited = engine.blocked_seconds() - blocked
            assert LATE_S * 0.5 <= waited < LATE_S * 10, f"stage {stage}: blocked {waited:.3f} s for a late rank"
        engine.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        close(engine.full_state_dict(), ref_model.state_dict(), f"stage {stage} {kind} step {k}")
    if stage == 3:   # from the second step on, each unit's gather was started while the one before ran
        assert engine.prefetched >= 3 * 4, engine.prefetched


def sharded_round_trip(g, stage):
    """A sharded state (each rank its own chunks, through torch.save and back) loaded into a
    fresh engine continues exactly as the engine it came from; another stage is refused."""
    import io
    torch.manual_seed(0)
    engine = pt.ZeRO(Net(), torch.optim.Adam, stage=stage, group=g, lr=1e-2)
    for k in range(2):
        x, y = batch(g.rank, k)
        F.cross_entropy(engine(x), y).backward()
        engine.step()
        engine.zero_grad()
    buf = io.BytesIO()
    torch.save(engine.sharded_state_dict(), buf)
    torch.manual_seed(1)   # other weights: everything must come from the shard
    fresh = pt.ZeRO(Net(), torch.optim.Adam, stage=stage, group=g, lr=1e-2)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    fresh.load_sharded_state_dict(state)
    for e in (engine, fresh):
        x, y = batch(g.rank, 2)
        F.cross_entropy(e(x), y).backward()
        e.step()
    close(fresh.full_state_dict(), engine.full_state_dict(), f"stage {stage}: one step after a sharded load")
    other = pt.ZeRO(Net(), torch.optim.Adam, stage=1 + stage % 3, group=g, lr=1e-2)
    try:
        other.load_sharded_state_dict(state)
    except ValueError as e:
        assert f"saved with stage {stage}, this run has {1 + stage % 3}" in str(e), e
    else:
        raise AssertionError("a sharded state of another stage was loaded")


def memory(g, stage):
    """Per-rank bytes, measured after backward (full gradients, or their chunks, in
    place) and after the step, against the formulas with K = 8 (Adam's moments)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    P, N = sum(p.numel() for p in model.parameters()), g.world_size
    engine = pt.ZeRO(model, torch.optim.Adam, stage=stage, group=g, lr=1e-3)
    x = torch.randn(8, 256)
    for _ in range(2):   # Adam's state exists after the first step
        engine(x).square().mean().backward()
        if _ == 1:
            held = engine.memory()
        engine.step()
        engine.zero_grad()
    total = sum(held.values())
    formula = {1: (4 + 4) * P + 8 * P / N, 2: 4 * P + 12 * P / N, 3: 16 * P / N}[stage]
    assert abs(total - formula) <= 0.10 * formula, (stage, held, total, formula)
    return total, formula


def bad_input(g):
    said = []
    for call in (lambda: pt.ZeRO(Net(), torch.optim.Adam, stage=4, group=g),
                 lambda: pt.ZeRO(Net(), torch.optim.Adam(Net().parameters()), group=g)):
        try:
            call()
        except (ValueError, TypeError) as e:
            said.append(str(e))
    assert "stage must be 1, 2 or 3" in said[0] and "give the optimizer's class" in said[1], said
    try:   # units= picks stage 3's gathered modules; stages 1 and 2 cut buckets
        pt.ZeRO(Net(), torch.optim.SGD, stage=1, group=g, units=[nn.Linear], lr=0.1)
    except ValueError as e:
        assert "units= is for stage 3" in str(e), e
    else:
        raise AssertionError("units= was accepted at stage 1")


def one_process_reference(steps, ranks_per_step):
    """One process, Adam, each step on the batches of that step's ranks together:
    what ZeRO (as any data parallelism) must equal."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for k, ranks in zip(range(steps), ranks_per_step):
        xs, ys = zip(*(batch(r, k) for r in range(ranks)))
        F.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def checkpoint(g, mode, path, stage):
    """save (2 ranks): two steps, then the full model and optimizer state to ``path``.
    load (3 ranks, another stage): resliced, equal to one process after those two
    steps, model and Adam state; one more step on 3 ranks, still equal."""
    torch.manual_seed(0)
    engine = pt.ZeRO(Net(), torch.optim.Adam, stage=stage, group=g, lr=1e-2)
    if mode == "save":
        for k in range(2):
            x, y = batch(g.rank, k)
            F.cross_entropy(engine(x), y).backward()
            engine.step()
            engine.zero_grad()
        state = {"model": engine.full_state_dict(), "optimizer": engine.full_optimizer_state()}
        if g.rank == 0:
            torch.save(state, path)
        return
    saved = torch.load(path, weights_only=True)
    engine.load_full_state_dict(saved["model"])
    engine.load_full_optimizer_state(saved["optimizer"])
    ref, ref_opt = one_process_reference(2, [2, 2])
    close(engine.full_state_dict(), ref.state_dict(), "resumed")
    mine, want = engine.full_optimizer_state(), ref_opt.state_dict()
    assert mine["param_groups"] == want["param_groups"], (mine["param_groups"], want["param_groups"])
    for i, entries in want["state"].items():
        close(mine["state"][i], entries, f"resumed Adam state of parameter {i}")
    x, y = batch(g.rank, 2)
    F.cross_entropy(engine(x), y).backward()
    engine.step()
    ref, _ = one_process_reference(3, [2, 2, g.world_size])
    close(engine.full_state_dict(), ref.state_dict(), "one step after resuming")


def main():
    g = pt.init()
    if len(sys.argv) > 1:   # save PATHS STAGES | load PATHS STAGES: comma lists, taken in pairs
        for path, stage in zip(sys.argv[2].split(","), sys.argv[3].split(","), strict=True):
            checkpoint(g, sys.argv[1], path, int(stage))
        print(f"zero checkpoint {sys.argv[1]} passed on rank {g.rank}", flush=True)
        pt.destroy()
        return
    for stage in (1, 2, 3):
        for kind in ("adam", "sgd"):
            equal_to_data_parallel(g, stage, kind)
    for stage in (1, 2, 3):
        sharded_round_trip(g, stage)
    sizes = [memory(g, stage) for stage in (1, 2, 3)]
    bad_input(g)
    if g.rank == 0:
        print("memory (measured, formula):", sizes, flush=True)
    print(f"zero passed on rank {g.rank}", flush=True)
    pt.destroy()


if __name__ == "__main__":
    sys.exit(main())
