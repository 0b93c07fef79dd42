"""The built-in models: an MLP, a small CNN for 8x8 digits, and a minimal GPT.

None has dropout or batch norm. Dropout draws random numbers every step and
batch norm keeps running statistics, and either would make a run stopped at a
checkpoint and resumed differ from one that never stopped (or, for batch norm,
make each data-parallel worker's model differ). Without them a model is a pure
function of its parameters, and building one after ``torch.manual_seed(s)``
gives the same parameters every time.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    """Linear layers with ReLU between them; the input is flattened first.

    sizes = [in, hidden..., out]: MLP([784, 512, 512, 10]) has 0.67M
    parameters, MLP([784, 3072, 3072, 3072, 10]) 21.3M. Almost all the compute
    is in matrix products whose gradients are large, dense and ready in
    reverse layer order: the plainest load for comparing gradient all-reduce.
    """

    def __init__(self, sizes):
        super().__init__()
        if len(sizes) < 2:
            raise ValueError(f"an MLP needs at least an input and an output size, got {sizes}")
        self.sizes = list(sizes)
        layers = []
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(nn.Linear(a, b))
            if i < len(sizes) - 2:
                layers.append(nn.ReLU())
        self.layers = nn.Sequential(*layers)

    def forward(self, x):
        return self.layers(x.flatten(1))


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions, a 2x2 max-pool and two linear layers for 1x8x8 digits (10 classes).

    Small enough (38k parameters) that a CPU trains it to a high test
    accuracy in seconds, so ``paratrain train`` with no arguments shows a
    complete, successful run quickly.
    """

    def __init__(self, classes=10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, classes),
        )

    def forward(self, x):
        return self.classifier(self.features(x))


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t sees only positions <= t (Vaswani et al. 2017)."""

    def __init__(self, n_embd, n_head):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd ({n_embd}) must be a multiple of n_head ({n_head})")
        self.n_head, self.head_dim = n_head, n_embd // n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)  # q, k and v of every head in one product
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        # sizes from qkv's output, not x: under tensor parallelism (pt.tensor.parallelize) a
        # rank's qkv yields only its own heads, and proj takes only their width; under sequence
        # parallelism x holds this rank's tokens and qkv's output every token
        qkv = self.qkv(x)
        B, T, _ = qkv.shape
        q, k, v = qkv.chunk(3, dim=2)
        heads = q.shape[-1] // self.head_dim
        q, k, v = (t.view(B, T, heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        # softmax(q k^T / sqrt(d) + causal mask) v, fused; no dropout_p, so deterministic.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, heads * self.head_dim))


class Block(nn.Module):
    """A pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x)).

    LayerNorm before each sub-layer rather than after (GPT-2, Radford et al.
    2019, sec. 2.3; Xiong et al. 2020, arXiv 2002.04745) keeps the residual
    path an identity, which lets the model train at a high learning rate with
    no warm-up: what a 300-step default run needs.
    """

    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def check_length(length, block_size):
    if length > block_size:
        raise ValueError(f"sequence of length {length} is longer than the model's block_size {block_size}")


torch.fx.wrap("check_length")   # traced as one call (run when the graph runs), not looked into


class GPT(nn.Module):
    """A minimal decoder-only transformer in the style of Karpathy's nanoGPT (GPT-2: Radford et al. 2019).

    Token and learned position embeddings, n_layer pre-LN blocks, a final
    LayerNorm and a linear head to vocab_size logits. ``forward(idx)`` takes
    (B, T) token ids with T <= block_size and returns (B, T, vocab) logits.

    Unlike nanoGPT the head is not tied to the token embedding: with a 256-byte
    vocabulary tying saves only vocab x n_embd parameters, and a parameter used
    in two places would sit on both the first and the last stage under
    pipeline parallelism and in two shards under ZeRO.
    """

    def __init__(self, vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128):
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.apply(self._init)
        # GPT-2 (sec. 2.3) scales the weights of the layers that write into the
        # residual stream by 1/sqrt(N), N the number of such writes (2 per block),
        # so the stream's variance does not grow with depth; nanoGPT does the same.
        for block in self.blocks:
            for layer in (block.attn.proj, block.mlp[2]):
                nn.init.normal_(layer.weight, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(m):
        # GPT-2's initialisation: N(0, 0.02) for every weight matrix and embedding, zero biases;
        # LayerNorm keeps its (1, 0).
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx):
        T = idx.shape[1]
        check_length(T, self.block_size)   # a call, not an if: torch.fx traces it (pipeline parallelism cuts this model)
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))
