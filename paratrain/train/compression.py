"""``--compression``: how gradients travel, for the strategies that send them.

One option for every strategy, since what it means is the same (a gradient's
compressed form: parallel/compression/); which strategies take it, and what
each compresses, is theirs to say (COMPRESSES in their modules, gathered by
the strategy table), so this module names none of them.
"""
import argparse

from . import strategies

COMPRESSIONS = ("none", "fp16", "bf16", "topk:<ratio>", "powersgd:<rank>", "onebit")


def compression_spec(text):
    """One of COMPRESSIONS, its argument checked and written out (topk:0.01, powersgd:4)."""
    kind, _, arg = text.partition(":")
    if text in ("none", "fp16", "bf16", "onebit"):
        return text
    if kind == "topk":
        try:
            ratio = float(arg or 0.01)
        except ValueError:
            ratio = -1
        if 0 < ratio <= 1:
            return f"topk:{ratio}"
        raise argparse.ArgumentTypeError(f"{text!r}: topk takes the fraction of entries sent, in (0, 1], "
                                         "e.g. topk:0.01")
    if kind == "powersgd":
        if (arg or "4").isdigit() and int(arg or 4) >= 1:
            return f"powersgd:{int(arg or 4)}"
        raise argparse.ArgumentTypeError(f"{text!r}: powersgd takes the rank, a positive integer, e.g. powersgd:4")
    raise argparse.ArgumentTypeError(f"unknown compression {text!r}; choose {', '.join(COMPRESSIONS)}")


def _takers():
    """'allreduce (gradient buckets) and ps (pushes)': who takes --compression, and for what."""
    return " and ".join(f"{name} ({what})" for name, what in strategies.compressing().items())


def add_options(parser):
    parser.add_argument("--compression", type=compression_spec, default="none",
                        help=f"how gradients travel, for --strategy {_takers()}: none, fp16 / bf16 (cast), "
                             "topk:<ratio> (the largest entries, error feedback; e.g. topk:0.01), powersgd:<rank> "
                             "(low-rank, e.g. powersgd:4), onebit (scaled signs, error feedback)")


def check(args):
    """A strategy that sends no gradients, or does not compress them, refuses --compression
    (its own check may have said so first, in its own words)."""
    if args.compression != "none" and args.strategy not in strategies.compressing():
        return f"--compression is for --strategy {_takers()}, not {args.strategy}"
    return None
