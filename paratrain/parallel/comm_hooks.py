"""How a gradient bucket is averaged across workers: the hook point for compression.

DataParallel calls ``hook(group, index, flat)`` for each bucket, on its own
communication thread, in the same bucket order on every rank; the hook must
leave the *average* of all ranks' ``flat`` in ``flat``. ``prepare(group, flats)``
runs once at construction (collective), to allocate what the hook needs.
This is the role of DDP's ``register_comm_hook`` (arXiv 2006.15704, and
``torch.distributed.algorithms.ddp_comm_hooks``); parallel/compression/ adds
top-k, PowerSGD and 1-bit as further hooks.
"""
import torch

from ..trace import span


class AllReduceHook:
    """The default: an all-reduce with op avg, in place."""

    def __init__(self, algorithm=None):
        self.algorithm = algorithm

    def prepare(self, group, flats):
        pass

    def wire_bytes(self, flat):
        """Bytes each rank contributes to the all-reduce (for the run's summary)."""
        return flat.numel() * flat.element_size()

    def __call__(self, group, index, flat):
        group.all_reduce(flat, op="avg", algorithm=self.algorithm)


class CastHook(AllReduceHook):
    """All-reduce a half-precision copy: half the bytes, at the cost of rounding.

    Each rank divides by the world size *before* the sum (as DDP's
    fp16_compress_hook does), so the sum of P values cannot overflow float16
    where the mean would not. The low-precision buffers are shared tensors too.
    """

    def __init__(self, dtype, algorithm=None):
        super().__init__(algorithm)
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"CastHook compresses to float16 or bfloat16, not {dtype}")
        self.dtype = dtype
        self.low = []
        kind = "fp16" if dtype == torch.float16 else "bf16"
        self.encoding, self.decoding = f"{kind} encode", f"{kind} decode"

    def prepare(self, group, flats):
        self.low = [group.empty_shared(f.numel(), self.dtype) for f in flats]

    def wire_bytes(self, flat):
        return flat.numel() * torch.finfo(self.dtype).bits // 8

    def __call__(self, group, index, flat):
        low = self.low[index]
        with span(self.encoding, "compute", "compression", bucket=index):
            torch.div(flat, group.world_size, out=flat)
            low.copy_(flat)
        group.all_reduce(low, op="sum", algorithm=self.algorithm)
        with span(self.decoding, "compute", "compression", bucket=index):
            flat.copy_(low)


def make_hook(compression=None, algorithm=None):
    """A hook from a name ("none", "fp16", "bf16", "topk:0.01", "onebit") or a hook
    object, as given (compression/ has the compressors)."""
    if compression is None or compression == "none":
        return AllReduceHook(algorithm)
    if compression == "fp16":
        return CastHook(torch.float16, algorithm)
    if compression == "bf16":
        return CastHook(torch.bfloat16, algorithm)
    if isinstance(compression, str):
        from .compression import parse
        hook = parse(compression)
        if hook is not None:
            return hook
    if callable(compression):
        return compression
    raise ValueError(f"unknown compression {compression!r}; use 'none', 'fp16', 'bf16', 'topk:<ratio>', "
                     "'onebit' or a hook object")
