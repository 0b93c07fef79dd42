"""Your own model and data set with paratrain's data parallelism.

    paratrain run -n 2 examples/train_custom.py --epochs 3

Every worker runs this file. pt.init() joins the job the launcher started;
DataParallel broadcasts rank 0's weights and averages gradients during
backward; DistributedSampler gives each worker its own shard of every epoch.
The model and data here are deliberately plain (a regression on generated
data, whose exact answer numpy gives): swap in your own.
"""
import argparse

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import paratrain as pt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    args = ap.parse_args()

    g = pt.init()
    rng = np.random.default_rng(0)  # the same data set on every worker; the sampler shards it
    x = rng.normal(size=(4096, 16)).astype(np.float32)
    w_true = rng.normal(size=(16, 1)).astype(np.float32)
    y = x @ w_true + 0.01 * rng.normal(size=(4096, 1)).astype(np.float32)
    ds = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))

    model = pt.DataParallel(torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    sampler = pt.DistributedSampler(ds, seed=0)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            loss = F.mse_loss(model(xb), yb)
            loss.backward()  # gradients are averaged across workers here
            opt.step()
            opt.zero_grad()
        if g.rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.5f}")
    err = (model.module.weight.detach().numpy().T - w_true).__abs__().max()
    if g.rank == 0:
        print(f"largest error against the true weights: {err:.4f}")


if __name__ == "__main__":
    main()
