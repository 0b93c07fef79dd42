"""Your own transformer with its layers cut across workers (tensor parallelism).

    paratrain run -n 2 examples/train_tensor.py --steps 40
    paratrain run -n 4 examples/train_tensor.py --tp 2     # 2 replicas x 2-way tensor parallel

pt.mesh lays the workers out as data-parallel replicas of tensor-parallel
groups (--tp workers each). Every worker builds the whole model from the same
seed; pt.tensor.parallelize then keeps, in each attention and MLP layer named
by PLAN, this worker's share of the heads and hidden units (Megatron-LM's
cut: one all-reduce forward and one backward per layer pair). The workers of
a group all see the same batch and compute the same loss, which is one
process's (tests/test_examples.py checks this); replicas split the batch
and average their gradients. The data is a toy language: each token is
followed by one of two tokens, so the loss can fall to ln 2 = 0.69.
"""
import argparse

import torch
import torch.nn.functional as F
from torch import nn

import paratrain as pt

PLAN = {                                # which layers to cut across the group, and how
    "blocks.*.attn.qkv": "colwise:3",   # q, k and v by heads: each worker attends with its own heads
    "blocks.*.attn.proj": "rowwise",    # ... and their outputs are summed (one all-reduce)
    "blocks.*.mlp.0": "colwise",        # the MLP's hidden units likewise
    "blocks.*.mlp.2": "rowwise",
}


class Attention(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.head_dim = width // heads  # reshape by this, not by heads: a cut layer holds fewer heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab=16, context=16, width=64, heads=4, depth=2):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, width)
        self.pos_emb = nn.Parameter(torch.zeros(context, width))
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        x = self.tok_emb(ids) + self.pos_emb[:ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def make_model():
    torch.manual_seed(0)  # the same weights on every worker, before the cut
    return TinyLM()


def make_data(n=2048, vocab=16, context=17):
    """Sequences of a Markov chain in which each token has two equally likely successors."""
    g = torch.Generator().manual_seed(1)
    successors = torch.randint(0, vocab, (vocab, 2), generator=g)
    ids = torch.empty(n, context, dtype=torch.long)
    ids[:, 0] = torch.randint(0, vocab, (n,), generator=g)
    for t in range(1, context):
        ids[:, t] = successors[ids[:, t - 1], torch.randint(0, 2, (n,), generator=g)]
    return ids


def lm_loss(logits, ids):  # predict token t + 1 from tokens up to t
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2, help="workers per tensor-parallel group")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()

    g = pt.init()
    mesh = pt.mesh(dp=g.world_size // args.tp, tp=args.tp)  # mesh["tp"], mesh["dp"]: this worker's groups
    model = make_model()
    pt.tensor.parallelize(model, group=mesh["tp"], plan=PLAN)  # in place; unnamed layers stay whole
    replicas, replica = mesh["dp"].world_size, mesh.coords["dp"]
    if replicas > 1:
        model = pt.DataParallel(model, group=mesh["dp"])  # averages gradients across replicas
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    data = make_data()
    for step in range(args.steps):
        i = step * args.batch_size % len(data)
        batch = data[i:i + args.batch_size][replica::replicas]  # the same rows for a whole TP group
        loss = lm_loss(model(batch[:, :-1]), batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if g.rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step}: loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
