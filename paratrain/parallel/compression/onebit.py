"""1-bit (scaled sign) compression with error feedback (Seide et al., "1-Bit
Stochastic Gradient Descent and its Application to Data-Parallel Distributed
Training of Speech DNNs", Interspeech 2014; the scaled sign of Karimireddy et
al., "Error Feedback Fixes SignSGD", arXiv 1901.09847).

Each rank sends the sign of each entry of (gradient + residual), packed 8 to
a byte, and for each block of entries one float: their mean magnitude, so
that scale x sign has the same L1 norm as what it stands for. The
difference is the new residual (error feedback), so nothing is lost, only
delayed. 3/16 of a byte an entry: 4.7% of fp32's bytes.
"""
import numpy as np
import torch

from .base import Compressor


class OneBit(Compressor):
    """block: entries sharing one scale. One scale for a whole bucket lets its largest
    layer's magnitudes set every layer's step; a scale per block of 64 entries (as
    1-bit SGD quantizes each column with its own values) costs 4 bytes in 64 more:
    on the digits task one scale a bucket (or one per 256 entries) ends at 61-69%
    accuracy against 98.6% uncompressed, one per 64 at 98.1%."""

    def __init__(self, block=64):
        super().__init__()
        self.block = int(block)
        self.residual = {}

    def wire_bytes(self, flat):
        n = flat.numel()
        return (n + 7) // 8 + 4 * -(-n // self.block)

    def __call__(self, group, index, flat):
        n, p, b = flat.numel(), group.world_size, self.block
        acc = self.residual.get(index)
        acc = flat.clone() if acc is None else acc.add_(flat)
        blocks = -(-n // b)
        padded = torch.zeros(blocks * b, dtype=acc.dtype)
        padded[:n] = acc.abs()
        counts = torch.full((blocks,), float(b))
        counts[-1] = n - (blocks - 1) * b
        scale = (padded.view(blocks, b).sum(1) / counts).to(torch.float32)   # mean magnitude per block
        positive = acc >= 0
        per_entry = scale.repeat_interleave(b)[:n].to(acc.dtype)
        sent = torch.where(positive, per_entry, -per_entry)
        self.residual[index] = acc.sub_(sent)
        self.sent[index] = sent
        bits = torch.from_numpy(np.packbits(positive.numpy()))
        all_bits = torch.empty(p * bits.numel(), dtype=torch.uint8)
        scales = torch.empty(p * blocks, dtype=torch.float32)
        group.all_gather(all_bits, bits)
        group.all_gather(scales, scale)
        signs = np.unpackbits(all_bits.numpy().reshape(p, -1), axis=1, count=n).astype(np.float32) * 2 - 1
        magnitudes = np.repeat(scales.numpy().reshape(p, blocks), b, axis=1)[:, :n]
        flat.copy_(torch.from_numpy((signs * magnitudes).sum(axis=0) / p))
