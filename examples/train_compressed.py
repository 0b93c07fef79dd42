"""Your own model trained data-parallel with compressed gradients.

    paratrain run -n 2 examples/train_compressed.py --compression powersgd
    paratrain run -n 2 examples/train_compressed.py --compression topk      # or onebit

As examples/train_custom.py, but DataParallel hands each bucket of gradients
to a compressor, which sends a small stand-in for it and leaves the average
of the workers' stand-ins in the bucket: PowerSGD a rank-2 factorisation of
each weight matrix, top-k the 5% largest entries, 1-bit their signs and one
scale per 32 entries. What a worker did not send it keeps and adds to its
next gradient (error feedback), so the model still learns. Rank 0 prints the
bytes sent a step against plain averaging's, and the loss on all the data
before and after training.
"""
import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain as pt
from paratrain.parallel.compression import OneBit, PowerSGD, TopK

COMPRESSORS = {  # name: (the compressor, the momentum left to SGD)
    "powersgd": (lambda: PowerSGD(rank=2), 0.9),
    "topk": (lambda: TopK(0.05, momentum=0.9), 0.0),  # momentum before the selection (DGC), so none in SGD
    "onebit": (lambda: OneBit(), 0.9),
}


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4))


def make_data(n=4096):
    """Points in 32 dimensions, labelled by a random linear rule into 4 classes."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 32, generator=g)
    y = (x @ torch.randn(32, 4, generator=g)).argmax(1)
    return x, y


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--compression", default="powersgd", choices=sorted(COMPRESSORS))
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    args = ap.parse_args()

    g = pt.init()
    x, y = make_data()
    ds = TensorDataset(x, y)
    compressor, momentum = COMPRESSORS[args.compression]
    model = pt.DataParallel(make_model(), compression=compressor())
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=momentum)
    sampler = pt.DistributedSampler(ds, seed=0)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler)
    if g.rank == 0:
        with torch.no_grad():
            print(f"loss on all the data before training: {F.cross_entropy(model.module(x), y).item():.6f}")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            F.cross_entropy(model(xb), yb).backward()  # buckets compressed and averaged here
            opt.step()
            opt.zero_grad()
    if g.rank == 0:
        sent = sum(model.hook.wire_bytes(b.flat) for b in model.buckets)
        whole = sum(b.flat.numel() * b.flat.element_size() for b in model.buckets)
        print(f"{args.compression}: {sent:,} bytes sent a step, plain averaging sends {whole:,}")
        with torch.no_grad():
            print(f"loss on all the data after training: {F.cross_entropy(model.module(x), y).item():.6f}")


if __name__ == "__main__":
    main()
