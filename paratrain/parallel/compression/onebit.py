"""1-bit (scaled sign) compression with error feedback (Seide et al., "1-Bit
Stochastic Gradient Descent and its Application to Data-Parallel Distributed
Training of Speech DNNs", Interspeech 2014; the scaled sign of Karimireddy et
al., "Error Feedback Fixes SignSGD", arXiv 1901.09847).

Each rank sends the sign of each entry of (gradient + residual), packed 8 to
a byte, and for each block of entries one float: their mean magnitude, so
that scale x sign has the same L1 norm as what it stands for. The
difference is the new residual (error feedback), so nothing is lost, only
delayed.
"""
import math

import numpy as np
import torch

from ...trace import span
from .base import Compressor


class OneBit(Compressor):
    """block: entries sharing one scale, counted inside each gradient tensor (a block
    never spans two: a bias's scale is not set by the weights beside it).

    One scale for a whole bucket lets its largest layer's magnitudes set every
    layer's step, and a block across a tensor boundary lets one tensor set its
    neighbour's; small blocks inside each tensor keep each scale close to the
    entries it stands for.
    32 entries share a 2-byte scale: 1/8 + 1/16 of a byte an entry, 4.7% of fp32's."""

    wants_shapes = True
    STATE = PER_RANK = ("residual",)

    def __init__(self, block=32):
        super().__init__()
        self.block = int(block)
        self.residual = {}

    def _runs(self, index, n):
        """(offset, entries) of each gradient in bucket ``index`` (prepare's layout), where
        blocks are counted; one run of n entries for a bucket it was not told of."""
        runs = self.layout[index] if index is not None and index < len(self.layout) else []
        runs = [(at, math.prod(shape)) for at, shape in runs]
        return runs if runs and sum(size for _, size in runs) == n else [(0, n)]

    def wire_bytes(self, flat):
        n = flat.numel()
        blocks = sum(-(-size // self.block) for _, size in self._runs(self._index.get(id(flat)), n))
        return (n + 7) // 8 + 2 * blocks

    def encode(self, index, flat):
        """This rank's packed signs (uint8) and bfloat16 block scales for ``flat`` plus its
        residual; the difference stays as the new residual (error feedback). Also what a
        parameter-server push sends (ps/push_codecs.py)."""
        n, b = flat.numel(), self.block
        runs = self._runs(index, n)
        acc = self.residual.get(index)
        acc = flat.clone() if acc is None else acc.add_(flat)
        magnitude = acc.abs()
        # the scales travel as bfloat16 (fp32's range, 8 bits of mantissa): the rounding is the sender's,
        # and error feedback keeps what it loses
        scale = torch.cat([_block_means(magnitude[at:at + size], b) for at, size in runs]).to(torch.bfloat16)
        bits = torch.from_numpy(np.packbits((acc >= 0).numpy()))
        sent = decode(bits, scale, n, runs, b, acc.dtype)
        self.residual[index] = acc.sub_(sent)
        self.sent[index] = sent
        return bits, scale

    def __call__(self, group, index, flat):
        n, p = flat.numel(), group.world_size
        runs = self._runs(index, n)
        with span("onebit encode", "compute", "compression", bucket=index):
            bits, scale = self.encode(index, flat)
        all_bits = torch.empty(p * bits.numel(), dtype=torch.uint8)
        scales = torch.empty(p * scale.numel(), dtype=torch.bfloat16)
        group.all_gather(all_bits, bits)
        group.all_gather(scales, scale)
        with span("onebit decode", "compute", "compression", bucket=index):
            flat.zero_()
            for their_bits, their_scale in zip(all_bits.view(p, -1), scales.view(p, -1)):
                flat.add_(decode(their_bits, their_scale, n, runs, self.block, flat.dtype))
            flat.div_(p)


def decode(bits, scale, n, runs, block, dtype):
    """n entries: each packed sign times its block's scale (blocks counted inside each run)."""
    return _scaled_signs(_unpack(bits, n, dtype), scale, runs, block)


# +1 / -1 for each of the 8 bits of every byte value, most significant first (np.packbits's order):
# one index_select turns packed signs back into floats, no unpacking pass
_SIGNS = torch.from_numpy(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).astype(np.float32) * 2 - 1)


def _unpack(bits, n, dtype):
    """n signs (+1 / -1) from their packed bits."""
    return _SIGNS.to(dtype).index_select(0, bits.long()).view(-1)[:n]


def _block_means(values, b):
    """The mean of each run of b entries (the last run may be shorter)."""
    n, whole = values.numel(), values.numel() // b * b
    means = values[:whole].view(-1, b).mean(1)
    if whole < n:
        means = torch.cat([means, values[whole:].mean().view(1)])
    return means


def _scaled_signs(signs, scale, runs, b):
    """signs (+1/-1) times each block's scale, block by block inside each run, in place."""
    k = 0
    for at, size in runs:
        whole, blocks = size // b * b, -(-size // b)
        mine = signs[at:at + size]
        mine[:whole].view(-1, b).mul_(scale[k:k + whole // b, None].to(signs.dtype))
        if whole < size:
            mine[whole:].mul_(scale[k + blocks - 1].to(signs.dtype))
        k += blocks
    return signs
