"""Compressed gradient pushes to the parameter servers.

    ps.register(model, optimizer="sgd", lr=0.05, compression="topk:0.01")
    paratrain train --strategy ps --compression topk:0.01 | onebit | fp16 | bf16

A compressed push carries every piece a worker has on one server (their flat
gradients concatenated in the server's order: key -1, [0, n) for n entries in
all) in one message, as ps-lite batches a worker's keys per server, and as
DataParallel compresses a bucket of many tensors at once: one encode and one
message a server a step, not one a tensor. It travels as:

- ``fp16`` / ``bf16``: a PUSH whose dtype code is float16 / bfloat16 (the
  header's element count still holds); the server widens it to float32;
- ``topk:<r>``: a PUSH_PACKED, meta ``{"codec": "topk", "k": k}``, payload k
  int32 offsets into the concatenation then k float32 values (DGC: the k
  entries of largest magnitude, the rest kept as the worker's residual; the
  smallest pieces, biases, sent whole as DataParallel's top-k sends them);
- ``onebit``: a PUSH_PACKED, meta ``{"codec": "onebit", "block": b}``,
  payload the packed signs (ceil(n / 8) bytes) then one bfloat16 scale per
  block of b entries, blocks counted inside each piece (scaled sign, error
  feedback).

Error feedback lives at the worker, one residual per server, exactly as in
DataParallel's compressors (parallel/compression/: the same ``encode``, each
server's pieces a bucket), so nothing a worker computed is lost, only
delayed. The server averages the decoded gradients as it does plain ones.
PowerSGD is refused: its second factor needs the workers' first factors
averaged first (an all-reduce among workers, not a push to a server).

With compression set, every push takes this path, also to a server on the
same host (whose shared-memory path would move no network bytes at all):
compression is asked for where the link is slow, and a test on one host
must see what a remote server would.

The server trusts nothing in a packed push: the codec must be known, the
sizes must match its pieces exactly and every offset must fall inside them
(``decode`` raises FrameError saying which).
"""
import itertools

import numpy as np
import torch

from ..comm.errors import FrameError
from ..parallel.compression import onebit as onebit_mod
from ..parallel.compression import parse as parse_compressor

CODES = {"fp16": 1, "bf16": 2}   # comm.ops dtype codes
FLOAT32 = 3
CHOICES = ("none", "fp16", "bf16", "topk:<ratio>", "onebit")


class PushCodec:
    """A worker's compression of its pushes: ``encode(piece, grad)`` gives what to send."""

    def __init__(self, spec):
        self.spec = spec
        kind = spec.partition(":")[0]
        if kind == "powersgd":
            raise ValueError("compression powersgd cannot compress parameter-server pushes: its second factor "
                             "needs every worker's first factor averaged first, an all-reduce among workers; "
                             f"use one of {', '.join(CHOICES)} with the parameter servers")
        self.kind = kind
        self.compressor = None if kind in CODES else parse_compressor(spec)
        if kind not in CODES and self.compressor is None:
            raise ValueError(f"unknown compression {spec!r} for parameter-server pushes; choose {', '.join(CHOICES)}")

    def prepare(self, sizes):
        """``sizes[s]``: the entries of each piece this worker pushes to server s, in the
        server's order; each server's pieces are one bucket of the compressor's."""
        if self.compressor is not None:
            self.compressor.prepare(None, [torch.empty(sum(pieces)) for pieces in sizes],
                                    [[(n,) for n in pieces] for pieces in sizes])

    def encode(self, server, grad):
        """(packed, dtype code, meta, payload) for the float32 numpy ``grad`` of every piece
        this worker has on ``server``: packed says PUSH_PACKED (else a PUSH of that dtype
        code)."""
        if self.kind == "fp16":
            return False, CODES["fp16"], None, grad.astype(np.float16)
        if self.kind == "bf16":
            return False, CODES["bf16"], None, torch.from_numpy(grad).to(torch.bfloat16).view(torch.int16).numpy()
        flat = torch.from_numpy(grad)
        if self.kind == "topk":
            chosen, values = self.compressor.encode(server, flat)
            payload = np.concatenate([chosen.to(torch.int32).numpy().view(np.uint8),
                                      values.to(torch.float32).numpy().view(np.uint8)])
            return True, 7, {"codec": "topk", "k": int(chosen.numel())}, payload
        bits, scale = self.compressor.encode(server, flat)
        payload = np.concatenate([bits.numpy(), scale.view(torch.int16).numpy().view(np.uint8)])
        return True, 7, {"codec": "onebit", "block": self.compressor.block}, payload


def widen(dtype_code, payload, n):
    """A plain PUSH's gradient as float32 (fp16 and bf16 pushes widened)."""
    if dtype_code == FLOAT32:
        grad = np.frombuffer(payload, dtype=np.float32)
    elif dtype_code == CODES["fp16"]:
        grad = np.frombuffer(payload, dtype=np.float16).astype(np.float32)
    elif dtype_code == CODES["bf16"]:
        bits = np.frombuffer(payload, dtype=np.uint16).astype(np.uint32) << 16
        grad = bits.view(np.float32)
    else:
        raise FrameError(f"a push carries float32, float16 or bfloat16 gradients, not dtype code {dtype_code}")
    if grad.size != n:
        raise FrameError(f"push of {grad.size} values for a shard of {n}")
    return grad


def decode(meta, payload, sizes):
    """A PUSH_PACKED's gradient for pieces of ``sizes`` entries, concatenated, as float32;
    FrameError if it does not describe exactly those."""
    codec, n = meta.get("codec"), sum(sizes)
    raw = np.frombuffer(payload, dtype=np.uint8)
    if codec == "topk":
        k = meta.get("k")
        if not isinstance(k, int) or not 0 < k <= n or raw.size != 8 * k:
            raise FrameError(f"a top-k push of {n} entries needs 0 < k <= {n} and 8k payload bytes, "
                             f"got k={k!r} and {raw.size} bytes")
        offsets = raw[:4 * k].view(np.int32)
        if offsets.min() < 0 or offsets.max() >= n:
            raise FrameError(f"a top-k push names offsets outside its {n} entries "
                             f"({int(offsets.min())}..{int(offsets.max())})")
        grad = np.zeros(n, dtype=np.float32)
        np.add.at(grad, offsets, raw[4 * k:].view(np.float32))
        return grad
    if codec == "onebit":
        block = meta.get("block")
        if not isinstance(block, int) or block < 1:
            raise FrameError(f"a 1-bit push needs a positive int block, got {block!r}")
        nbits = -(-n // 8)
        runs = list(zip(itertools.accumulate(sizes, initial=0), sizes))   # (offset, entries) of each piece
        blocks = sum(-(-size // block) for size in sizes)
        if raw.size != nbits + 2 * blocks:
            raise FrameError(f"a 1-bit push of pieces of {list(sizes)} entries in blocks of {block} needs "
                             f"{nbits + 2 * blocks} bytes, got {raw.size}")
        bits = torch.from_numpy(raw[:nbits].copy())
        scale = torch.from_numpy(raw[nbits:].copy().view(np.int16)).view(torch.bfloat16)
        return onebit_mod.decode(bits, scale, n, runs, block, torch.float32).numpy()
    raise FrameError(f"unknown push codec {codec!r}: mixed paratrain versions? (known: topk, onebit)")
