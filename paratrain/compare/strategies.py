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
"""
NAMES = ("dp", "dp-naive", "ps-bsp", "ps-asp", "ps-ssp", "pipeline", "pipeline-zb", "tensor", "zero1", "zero2",
         "zero3", "topk", "powersgd")
SSP_STALENESS = 2


def train_flags(name, workers):
    """The ``paratrain train`` flags of strategy ``name`` on ``workers`` workers."""
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


def parse_names(text):
    """--strategies: comma-separated names, or all."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or names == ["all"]:
        return list(NAMES)
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise ValueError(f"unknown strategy {unknown[0]!r} in --strategies; choose from {', '.join(NAMES)} or all")
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
