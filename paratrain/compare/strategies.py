"""compare's strategy names, each the ``paratrain train`` flags that run it.

The names are the ones ``paratrain simulate`` predicts (simulate/strategies.py),
so a measured row and a predicted one meet by name. Whether a name can run
with the model and workers given is train's own check (options.check), so
the reason a user reads is the one ``paratrain train`` would print.

Choices a user of each would expect, written down: pipeline and pipeline-zb
cut the model into --workers stages (one replica: the pipeline at its most
cut), tensor cuts it across all --workers (--tp), ps-* run one server
(paratrain train's default) and ps-ssp a staleness bound of 2 clocks, top-k
sends 1% of the entries and PowerSGD rank 4 (train's defaults).

Besides them, ``all`` runs the combinations the worker count allows: every
dp x pp x tp = --workers with two or three of them above 1, named by those
(``dp2-pp2``, ``dp2-tp2``, ``pp2-tp2`` at 4 workers; ``dp2-pp2-tp2`` at 8),
each a 1F1B pipeline of 4 micro-batches where it has stages. A combination
named in --strategies that does not multiply to --workers is listed with
train's reason.
"""
import re

NAMES = ("dp", "dp-naive", "ps-bsp", "ps-asp", "ps-ssp", "pipeline", "pipeline-zb", "tensor", "zero1", "zero2",
         "zero3", "topk", "powersgd")
SSP_STALENESS = 2


COMBINATION = re.compile(r"(?:dp(\d+))?-?(?:pp(\d+))?-?(?:tp(\d+))?")


def combination(name):
    """(dp, pp, tp) of a combination's name (dp2-pp2: (2, 2, 1)), or None for another name."""
    match = COMBINATION.fullmatch(name)
    if name in NAMES or not match or not any(match.groups()):
        return None
    dp, pp, tp = (int(g) if g else 1 for g in match.groups())
    return (dp, pp, tp) if sum(1 for k in (dp, pp, tp) if k > 1) >= 2 and min(dp, pp, tp) >= 1 else None


def combinations(workers):
    """The names of every dp x pp x tp = ``workers`` with at least two of them above 1."""
    sizes = [d for d in range(1, workers + 1) if workers % d == 0]
    out = []
    for pp in sizes:
        for tp in (t for t in sizes if workers % (pp * t) == 0):
            dp = workers // (pp * tp)
            if sum(1 for k in (dp, pp, tp) if k > 1) >= 2:
                out.append("-".join(f"{k}{v}" for k, v in (("dp", dp), ("pp", pp), ("tp", tp)) if v > 1))
    return out


def train_flags(name, workers):
    """The ``paratrain train`` flags of strategy ``name`` on ``workers`` workers."""
    layout = combination(name)
    if layout:
        dp, pp, tp = layout
        cut = ["--strategy", "pipeline", "--stages", str(pp)] if pp > 1 else ["--strategy", "allreduce"]
        return [*cut, *(["--tp", str(tp)] if tp > 1 else []), "--dp", str(dp)]
    return {
        "dp": ["--strategy", "allreduce"],
        "dp-naive": ["--strategy", "allreduce-naive"],
        "ps-bsp": ["--strategy", "ps", "--consistency", "bsp"],
        "ps-asp": ["--strategy", "ps", "--consistency", "asp"],
        "ps-ssp": ["--strategy", "ps", "--consistency", "ssp", "--staleness", str(SSP_STALENESS)],
        "pipeline": ["--strategy", "pipeline", "--stages", str(workers)],
        "pipeline-zb": ["--strategy", "pipeline", "--stages", str(workers), "--schedule", "zb-h1"],
        "tensor": ["--strategy", "allreduce", "--tp", str(workers)],
        "zero1": ["--strategy", "zero", "--stage", "1"],
        "zero2": ["--strategy", "zero", "--stage", "2"],
        "zero3": ["--strategy", "zero", "--stage", "3"],
        "topk": ["--strategy", "allreduce", "--compression", "topk:0.01"],
        "powersgd": ["--strategy", "allreduce", "--compression", "powersgd:4"],
    }[name]


def parse_names(text, workers=2):
    """--strategies: comma-separated names (compare's, or combinations such as dp2-pp2), or
    all: every name and the combinations of ``workers`` workers."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or names == ["all"]:
        return [*NAMES, *combinations(workers)]
    unknown = [n for n in names if n not in NAMES and not combination(n)]
    if unknown:
        raise ValueError(f"unknown strategy {unknown[0]!r} in --strategies; choose from {', '.join(NAMES)}, "
                         f"a combination such as dp2-pp2 or pp2-tp2, or all")
    return list(dict.fromkeys(names))


def refused(argv):
    """Why ``paratrain train argv`` would refuse to start, or None when it runs."""
    from ..train import layout, options
    args = options.build_parser().parse_args(argv)
    return layout.resolve(args, argv) or options.check(args)


def why_not(name, common):
    """Why ``paratrain train`` would refuse this strategy with the ``common`` flags (model,
    workers, ...), or None when it runs."""
    return refused([*common, *train_flags(name, int(common[common.index("--workers") + 1]))])
