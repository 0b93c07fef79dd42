"""Gradient compression behind DataParallel's hook (comm_hooks.py).

    pt.DataParallel(model, compression=TopK(0.01, momentum=0.9))   # topk.py: DGC
    pt.DataParallel(model, compression="onebit")                    # onebit.py: scaled sign
    pt.DataParallel(model, compression=PowerSGD(4))                 # powersgd.py: rank-4 power iteration
    paratrain train --compression topk:0.01 | powersgd:4 | onebit | fp16 | bf16

base.py states the hook contract; fp16/bf16 casts stay in comm_hooks.py.
"""
from .base import Compressor
from .onebit import OneBit
from .powersgd import PowerSGD
from .topk import TopK

__all__ = ["Compressor", "OneBit", "PowerSGD", "TopK"]

# DGC's density warm-up (arXiv 1712.01887, sec. 3.3) for top-k with SGD's momentum: without it
# the early steps' large gradients wait in the residual and, sent late, misguide the newer steps.
# DGC warms up over the first epochs of long runs; a short run warms up over its first tenth,
# so the warm-up's dense steps do not outweigh the sparse ones in the run's bytes.
SGD_TOPK_WARMUP_STEPS = 50
WARMUP_SHARE = 0.1


def warmup_steps(run_steps=None):
    """The density warm-up's length for a run of ``run_steps`` (None: not known)."""
    if run_steps is None:
        return SGD_TOPK_WARMUP_STEPS
    return max(1, min(SGD_TOPK_WARMUP_STEPS, int(run_steps * WARMUP_SHARE)))


def parse(spec):
    """A compressor from a CLI word: 'topk:0.01', 'onebit'; None for the others."""
    kind, _, arg = spec.partition(":")
    if kind == "topk":
        try:
            return TopK(float(arg or 0.01))
        except ValueError as e:
            raise ValueError(f"--compression {spec}: {e}; e.g. topk:0.01 (the fraction of entries sent)") from None
    if kind == "onebit":
        return OneBit()
    if kind == "powersgd":
        try:
            return PowerSGD(int(arg or 4))
        except ValueError as e:
            raise ValueError(f"--compression {spec}: {e}; e.g. powersgd:4 (the rank)") from None
    return None


def with_sgd_momentum(spec, momentum, run_steps=None):
    """(what DataParallel is given for the CLI word ``spec``, the momentum left to SGD), for
    SGD with ``momentum``: top-k takes the momentum (DGC's momentum correction, topk.py) and
    SGD runs without it, and the density warms up (``warmup_steps``); any other word
    leaves both as they are. ``paratrain train`` and the compression benchmark both ask
    here, so the benchmark trains as the CLI does."""
    kind, _, arg = (spec or "").partition(":")
    if kind == "topk" and momentum:
        return TopK(float(arg or 0.01), momentum=momentum, warmup_steps=warmup_steps(run_steps)), 0.0
    return spec, momentum
