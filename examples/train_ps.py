"""Your own model trained through a parameter server.

    paratrain run -n 2 --servers 1 examples/train_ps.py --steps 60
    paratrain run -n 4 --servers 2 examples/train_ps.py --consistency asp

The launcher starts the servers beside the workers. Worker 0's weights and
the optimizer (Adam here) go to the servers at register; then each step a
worker pulls the current weights, computes a gradient on its own shard of
the data, and pushes it; the servers apply it. Under SSP (the default) a
worker runs ahead of the slowest by at most --staleness steps instead of
waiting for it at every step as BSP does; ASP never waits. Rank 0 prints
the loss on all the data before training and, with the weights it pulls at
the end, after.
"""
import argparse
import torch
import torch.nn.functional as F
from torch import nn

import paratrain as pt


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def make_data(n=4096):
    """Points in 32 dimensions, labelled by a random linear rule into 4 classes."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 32, generator=g)
    y = (x @ torch.randn(32, 4, generator=g)).argmax(1)
    return x, y


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--consistency", default="ssp", choices=["bsp", "ssp", "asp"])
    ap.add_argument("--staleness", type=int, default=2, help="ssp: how many steps ahead a worker may run")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=32, help="per worker")
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()

    ps = pt.ps.connect()  # the servers `paratrain run --servers S` started
    me, workers = ps.worker, ps.workers
    model = make_model()
    ps.register(model, optimizer="adam", lr=args.lr, consistency=args.consistency,
                staleness=args.staleness if args.consistency == "ssp" else None)
    x, y = make_data()
    if me == 0:
        with torch.no_grad():
            print(f"loss on all the data before training: {F.cross_entropy(model(x), y).item():.6f}")
    mine_x, mine_y = x[me::workers], y[me::workers]  # this worker's shard
    for step in range(args.steps):
        ps.pull(model)  # the servers' weights now (under SSP, no staler than allowed)
        i = step * args.batch_size % len(mine_x)
        loss = F.cross_entropy(model(mine_x[i:i + args.batch_size]), mine_y[i:i + args.batch_size])
        loss.backward()
        ps.push(model)  # the gradient to the servers, whose Adam applies it
        ps.clock()      # this worker finished a step
        model.zero_grad()
    ps.pull(model)  # the final weights (under SSP/ASP the other worker may still be pushing its last steps)
    if me == 0:
        with torch.no_grad():
            print(f"loss on all the data after training: {F.cross_entropy(model(x), y).item():.6f}")
    ps.close()


if __name__ == "__main__":
    main()
