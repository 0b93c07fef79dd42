"""Your own model trained data-parallel with ZeRO: its state cut among the workers.

    paratrain run -n 2 examples/train_zero.py --steps 40 --stage 3

Each worker trains on its own share of every batch, as with DataParallel, but
holds only its share of the optimizer state (stage 1), of the gradients too
(stage 2), and of the parameters too (stage 3: each block is gathered just
before it runs and freed after). pt.ZeRO takes the optimizer's class and
arguments and steps the shards itself. The gradients are averaged over the
workers, so the losses printed (every worker's loss averaged) are one
process's on the whole batch (tests/test_examples.py checks this). At the
end rank 0 prints the bytes it holds: at stage 3, 1/N of one process's.
"""
import argparse

import torch
import torch.nn.functional as F
from torch import nn

import paratrain as pt


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Net(nn.Module):
    """A stack of residual blocks: stage 3 gathers one Block at a time."""

    def __init__(self, inputs=32, width=64, depth=4, classes=4):
        super().__init__()
        self.embed = nn.Linear(inputs, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_model():
    torch.manual_seed(0)  # the same weights on every worker
    return Net()


def make_data(n=4096):
    """Points in 32 dimensions, labelled by a random linear rule into 4 classes."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 32, generator=g)
    y = (x @ torch.randn(32, 4, generator=g)).argmax(1)
    return x, y


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, default=3, choices=[1, 2, 3])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=64, help="the global batch, split among the workers")
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()

    g = pt.init()
    x, y = make_data()
    engine = pt.ZeRO(make_model(), torch.optim.Adam, stage=args.stage, group=g, lr=args.lr)
    for step in range(args.steps):
        i = step * args.batch_size % len(x)
        mine = slice(i + g.rank, i + args.batch_size, g.world_size)  # this worker's share of the batch
        loss = F.cross_entropy(engine(x[mine]), y[mine])
        loss.backward()  # stages 2-3: gradients reduce-scattered to their owners here
        engine.step()
        engine.zero_grad()
        mean = loss.detach().clone()
        g.all_reduce(mean, op="avg")  # the whole batch's loss
        if g.rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step}: loss {mean.item():.6f}")
    held = sum(engine.memory().values())  # bytes of parameters, gradients and optimizer state here
    whole = sum(p.numel() for p in make_model().parameters()) * 4 * 3  # parameters and Adam's 2 moments
    if g.rank == 0:
        print(f"rank 0 holds {held:,} bytes of parameters and Adam state; one process holds {whole:,}")


if __name__ == "__main__":
    main()
