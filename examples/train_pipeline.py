"""Your own model cut between its layers into a pipeline, one stage per worker.

    paratrain run -n 2 examples/train_pipeline.py --steps 40

Every worker builds the whole model from the same seed; pt.pipeline.split
keeps this worker's stage (rank 0 the first layers, rank 1 the rest; rank 0
prints the cut). Each step the batch is cut into micro-batches that flow
through the stages on the 1F1B schedule: the first stage is given the
inputs, the last the targets, and every worker gets the batch's loss back.
The gradients are the ones one process would compute on the whole batch, so
the losses printed are one process's (tests/test_examples.py checks this).
The model and data are deliberately plain: swap in your own.
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
    """An input layer, a stack of residual blocks, a classifier: the pipeline cuts between blocks."""

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
    torch.manual_seed(0)  # the same weights on every worker, before the cut
    return Net()


def make_data(n=4096):
    """Points in 32 dimensions, labelled by a random linear rule into 4 classes."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 32, generator=g)
    y = (x @ torch.randn(32, 4, generator=g)).argmax(1)
    return x, y


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()

    g = pt.init()
    x, y = make_data()  # only the first stage reads x and the last y; building both everywhere is simpler
    stage = pt.pipeline.split(make_model(), group=g)  # this worker's layers, an nn.Module
    pipe = pt.Pipeline(stage, group=g, microbatches=args.microbatches, schedule="1f1b",
                       loss_fn=F.cross_entropy)
    opt = torch.optim.Adam(stage.parameters(), lr=args.lr)  # each stage steps its own parameters
    for step in range(args.steps):
        i = step * args.batch_size % len(x)
        xb, yb = x[i:i + args.batch_size], y[i:i + args.batch_size]
        loss = pipe.step(xb if stage.is_first else None, yb if stage.is_last else None)
        opt.step()
        opt.zero_grad()
        if g.rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step}: loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
