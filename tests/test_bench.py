"""The collectives benchmark runs end to end and reports every engine and collective.

A smoke test of the plumbing (launch, interleaved timing, checks, JSON, plot),
never of speed: on a shared 2-core machine timings say nothing, so nothing
here asserts on a time or a ratio. Open MPI is measured when mpirun and mpi4py
are installed and left out otherwise; the JSON says which.
"""
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from paratrain.bench.cases import COLLECTIVES
from paratrain.bench.collectives import main
from paratrain.bench.report import median_interval, ratios


MPI_INSTALLED = importlib.util.find_spec("mpi4py") is not None and shutil.which(
    "mpirun", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}") is not None

# nccl-tests' doc/PERFORMANCE.md, written out for 2 ranks: all_reduce 2(P-1)/P, broadcast
# and reduce 1, the rest (P-1)/P
NCCL_TESTS_FACTOR = {"all_reduce": 1.0, "broadcast": 1.0, "reduce": 1.0, "all_gather": 0.5,
                     "reduce_scatter": 0.5, "gather": 0.5, "scatter": 0.5, "all_to_all": 0.5}


def assert_pinned_to_own_cpus(environment):
    """--bind-to core, through mpirun or our own subprocesses: each of the 2 ranks
    ran on one CPU of this process's own, a different one when there are two."""
    cpus = sorted(os.sched_getaffinity(0))
    assert environment["bind_to"] == "core"
    got = environment["cpus_per_rank"]
    assert len(got) == 2 and all(len(c) == 1 and c[0] in cpus for c in got), got
    assert len(cpus) < 2 or got[0] != got[1], got


@pytest.mark.timeout(180)
def test_quick_benchmark_reports_every_engine_and_collective(tmp_path):
    code = main(["--quick", "-n", "2", "--sizes", "4K,64K", "--collectives", ",".join(COLLECTIVES),
                 "--bind-to", "core", "--out", str(tmp_path)])
    assert code == 0

    data = json.loads((tmp_path / "collectives.json").read_text())
    engines = data["config"]["engines"]
    assert engines[:2] == ["paratrain", "gloo"]
    assert ("mpi" in engines) == (data["environment"]["launcher"] == "mpirun")
    assert ("mpi" in engines) == MPI_INSTALLED   # the test command installs paratrain[mpi]: never dropped silently
    assert data["environment"]["world_size"] == 2
    for key in ("torch", "cpu_count", "date"):
        assert data["environment"][key]
    assert_pinned_to_own_cpus(data["environment"])

    got = {(r["collective"], r["engine"], r["bytes"]): r for r in data["results"]}
    for coll in COLLECTIVES:
        for engine in engines:
            for size in (4096, 65536):
                r = got[(coll, engine, size)]
                assert r["verified"], r
                assert r["iters"] == len(r["samples_us"]) > 0
                assert r["calls"] == 10   # small sizes: back-to-back calls per timed turn
                assert r["median_us"] > 0
                # nccl-tests: algbw = bytes / time, busbw = algbw x the collective's factor
                assert r["algbw_GBps"] == pytest.approx(size / (r["median_us"] * 1e3), rel=1e-3)
                assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * NCCL_TESTS_FACTOR[coll], rel=1e-3)
    assert {(r["collective"], r["bytes"]) for r in data["ratios"]} == {(c, s) for c in COLLECTIVES
                                                                          for s in (4096, 65536)}
    for r in data["ratios"]:
        m, lo, hi = r["paired_busbw_paratrain_over_gloo"]
        assert lo <= m <= hi
    png = tmp_path / "collectives.png"
    assert png.stat().st_size > 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(180)
def test_quick_benchmark_with_shared_buffers_extra_algorithms_and_the_hierarchical_run(tmp_path):
    """--buffers shared, --algorithms, --hierarchical and --interleave-sizes reach the JSON:
    each extra engine measured and its result checked against numpy like the others."""
    code = main(["--quick", "-n", "2", "--sizes", "4K,64K", "--collectives", "all_reduce,all_gather",
                 "--buffers", "shared", "--algorithms", "ring,tree", "--hierarchical", "--no-mpi",
                 "--bind-to", "core", "--interleave-sizes", "--out", str(tmp_path)])
    assert code == 0
    data = json.loads((tmp_path / "collectives.json").read_text())
    assert data["environment"]["launcher"] == "subprocesses"
    assert_pinned_to_own_cpus(data["environment"])
    assert data["config"]["buffers"] == "shared" and data["config"]["hierarchical"] is True
    assert data["config"]["interleave_sizes"] is True
    engines = {(r["engine"], r["run"]) for r in data["results"]}
    assert {("paratrain", "main"), ("paratrain/ring", "main"), ("paratrain/tree", "main"), ("gloo", "main"),
            ("paratrain-hier", "hierarchical")} <= engines, engines
    for r in data["results"]:
        assert r["verified"] and r["median_us"] > 0, r
    assert {r["collective"] for r in data["results"] if r["engine"] == "paratrain/ring"} == {"all_reduce"}


def test_interleaved_sizes_take_turns_in_every_round():
    """--interleave-sizes: round i times every size (the order rotated) before round i+1
    starts, each size its own rounds; every engine checked once per size."""
    import numpy as np

    from paratrain.bench.collectives_worker import _measure_interleaved
    log = []

    class Case:
        def __init__(self, nbytes):
            self.nbytes = nbytes

        def reset(self):
            pass

        def call(self, engine):
            log.append((self.nbytes, engine.name))

        def check(self, engine):
            return engine.name == "a"

    class Engine:
        def __init__(self, name):
            self.name = name

        def barrier(self):
            pass
    cases = [Case(1), Case(2), Case(3)]
    out = _measure_interleaved(cases, [Engine("a"), Engine("b")], [2, 3, 2], warmup=1, calls=[1, 1, 1])
    assert [t.shape for t, _ in out] == [(2, 2), (2, 3), (2, 2)]
    assert all(np.isfinite(t).all() and list(ok) == [1.0, 0.0] for t, ok in out)
    assert [n for n, _ in log] == [1, 1, 2, 2, 3, 3, 2, 2, 3, 3, 1, 1, 2, 2]   # size 2 has a third round
    assert log[:2] == [(1, "a"), (1, "b")] and log[6:8] == [(2, "b"), (2, "a")]   # engines rotate too


@pytest.mark.parametrize("n, ranks", [(6, (1, 6)), (10, (2, 9)), (20, (6, 15)), (100, (40, 61))])
def test_median_interval_takes_the_order_statistics_of_the_binomial_tables(n, ranks):
    """The 95% interval for a median from n samples is [x_(k), x_(n+1-k)]; the ranks
    are those of the published tables (Conover, Practical Nonparametric Statistics,
    table A3; n=100 also by the normal approximation n/2 -+ 1.96 sqrt(n)/2)."""
    xs = [10.0 * i for i in range(n, 0, -1)]   # unsorted on purpose
    m, lo, hi = median_interval(xs)
    assert (lo, hi) == (10.0 * ranks[0], 10.0 * ranks[1])
    assert m == 10.0 * (n + 1) / 2


def test_median_interval_with_too_few_samples_is_the_whole_range():
    # n = 5: even [x_(1), x_(5)] covers the median with only 1 - 2/32 = 93.75%
    assert median_interval([3.0, 1.0, 2.0, 5.0, 4.0]) == (3.0, 1.0, 5.0)


def test_paired_ratio_pairs_rounds_so_drift_cancels():
    """Times that drift 3x over the run, paratrain 10% faster in 40 rounds and
    stalled in 10: the ratio of the medians mixes the drift with the stalls (the
    two medians come from different rounds), the round-by-round ratio is 1.1 in
    the bulk, with the stalls below its interval. Sorting each engine's samples
    before pairing them would misalign the rounds and miss 1.1."""
    drift = [1.0 + 2.0 * (i % 7) / 6 for i in range(50)]
    pt = [100.0 * d for d in drift]
    for i in range(0, 50, 5):
        pt[i] = 1000.0   # rounds where paratrain alone stalled
    mpi = [110.0 * d for d in drift]
    rows = [dict(collective="all_gather", bytes=1 << 24, engine=e, verified=True, samples_us=s,
                 median_us=sorted(s)[25], busbw_GBps=1e4 / sorted(s)[25]) for e, s in (("paratrain", pt), ("mpi", mpi))]
    (row,) = ratios(rows)
    assert row["busbw_paratrain_over_mpi"] != pytest.approx(1.1, rel=0.01)
    m, lo, hi = row["paired_busbw_paratrain_over_mpi"]
    assert m == pytest.approx(1.1) and lo == pytest.approx(1.1) and hi == pytest.approx(1.1)


@pytest.mark.timeout(240)
def test_quick_pipeline_benchmark_reports_every_engine(tmp_path):
    """paratrain bench pipeline --quick: a tiny GPT, every engine, the table's numbers in JSON."""
    from paratrain.bench.pipeline import ENGINES
    from paratrain.bench.pipeline import main as pipeline_main
    assert pipeline_main(["--quick", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "pipeline.json").read_text())
    rows = {r["engine"]: r for r in data["rows"]}
    assert set(rows) == {"single", *ENGINES}
    for name, r in rows.items():
        assert r["step_ms"] > 0 and r["samples_per_s"] > 0
        if name.startswith("pt/"):
            assert r["vs_torch"] > 0 and 0 <= r["bubble"] < 1 and 0 < r["bubble_formula"] < 1
            assert len(r["peak_activation_mb"]) == 2 and min(r["peak_activation_mb"]) > 0
        m = int(name.rsplit("/m", 1)[1]) if "/m" in name and not name.startswith("alone/") else None
        if m is not None and f"alone/m{m}" in rows:   # the formula's ideal on this machine's stage compute
            assert r["machine_ideal"] == pytest.approx(rows[f"alone/m{m}"]["vs_single"] * m / (m + 1))
        elif name != "single" and not name.startswith("alone/"):
            assert r["machine_ideal"] is None, name
    assert (tmp_path / "pipeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name in ENGINES:
        if name.startswith("pt/"):
            assert (tmp_path / f"pipeline-timeline-{name.replace('/', '-')}.png").exists(), name


@pytest.mark.timeout(180)
def test_quick_tensor_benchmark_matches_one_process_and_the_formula(tmp_path):
    """paratrain bench tensor --quick: every engine starts from the same loss as one
    process, each rank holds the plan's share of the parameters, and paratrain's
    collectives move exactly Megatron's bytes (4 all-reduces of B x T x d a layer)."""
    from paratrain.bench.tensor import QUICK
    from paratrain.bench.tensor import main as tensor_main
    assert tensor_main(["--quick", "--sizes", "2", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "tensor.json").read_text())
    rows = {r["engine"]: r for r in data["rows"]}
    assert set(rows) == {"single", "pt/tp2", "pt-sp/tp2", "torch/tp2"}
    for r in rows.values():
        assert r["step_ms"] > 0
        assert r["first_loss"] == pytest.approx(rows["single"]["first_loss"], rel=1e-5)
        assert r["parameter_mb"] == pytest.approx(r["expected_parameter_mb"], rel=1e-9)
    B, T, d, L = QUICK["batch"], QUICK["context"], QUICK["width"], QUICK["layers"]
    ours = rows["pt/tp2"]
    assert ours["step_traffic_mb"] * 1e6 == pytest.approx((4 * L + 1) * B * T * d * 4)
    assert ours["traffic_calls"]["all_reduce"] == 4 * L + 1
    sp = rows["pt-sp/tp2"]   # reduce-scatters and all-gathers of B x T x d instead, and the norms' sums
    assert sp["traffic_calls"] == {"all_reduce": 1 + 6 * L + 2, "all_gather": 4 * L + 2, "reduce_scatter": 4 * L,
                                   "broadcast": 0}
    assert sp["step_traffic_mb"] * 1e6 == pytest.approx((8 * L + 3) * B * T * d * 4 + (6 * L + 2) * d * 4)
    assert 0.5 < ours["parameter_share"] < 0.6 and ours["optimizer_mb"] == pytest.approx(2 * ours["parameter_mb"], rel=1e-3)
    assert (tmp_path / "tensor.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(180)
def test_quick_zero_benchmark_compares_every_engine_from_the_same_start(tmp_path):
    """paratrain bench zero --quick: every engine starts from the same loss, our stages hold
    the paper's bytes (within 10%), and DDP and FSDP2 hold what DP and stage 3 do."""
    from paratrain.bench.zero import ENGINES
    from paratrain.bench.zero import main as zero_main
    assert zero_main(["--quick", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "zero.json").read_text())
    rows = {r["engine"]: r for r in data["rows"]}
    assert set(rows) == set(ENGINES)
    for r in rows.values():
        assert r["step_ms"] > 0 and r["first_loss"] == pytest.approx(rows["pt/dp"]["first_loss"], rel=1e-5)
        if r["formula_mb"]:
            assert r["total_mb"] == pytest.approx(r["formula_mb"], rel=0.10)
    assert rows["pt/zero3"]["total_mb"] < rows["pt/zero2"]["total_mb"] < rows["pt/zero1"]["total_mb"] < rows["pt/dp"]["total_mb"]
    assert rows["torch/ddp"]["total_mb"] == pytest.approx(rows["pt/dp"]["total_mb"], rel=0.02)
    assert set(rows["pt/zero1"]["vs"]) == {"pt/dp", "torch/zero1"}
    assert set(rows["pt/zero3"]["vs"]) == {"torch/fsdp2", "pt/zero3-noprefetch"}
    assert rows["pt/zero3-noprefetch"]["total_mb"] == pytest.approx(rows["pt/zero3"]["total_mb"], rel=1e-6)
    assert (tmp_path / "zero.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(240)
def test_quick_compression_benchmark_times_and_scores_every_engine(tmp_path):
    """paratrain bench compression --quick with no link limit (no root needed): every
    engine timed, ours scored after the accuracy run's steps (uncompressed and DDP on the
    same numbers), the bytes each sends a step as its compressor counts them."""
    from paratrain.bench.compression import main as compression_main
    engines = "pt/none,pt/topk:0.01,pt/powersgd:4,torch/ddp"
    assert compression_main(["--quick", "--links", "unlimited", "--engines", engines, "--accuracy-engines",
                             "pt/none,pt/topk:0.01", "--no-torch-powersgd", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "compression.json").read_text())
    rows = {r["engine"]: r for r in data["rows"]}
    assert set(rows) == set(engines.split(","))
    assert all(r["step_ms"] > 0 and r["link"] == "unlimited" for r in rows.values())
    assert rows["pt/none"]["bytes_share"] == 1.0 and rows["torch/ddp"]["bytes_share"] == 1.0
    # top-k's timed steps are past its warm-up: 1% of the large tensors' entries as index + value, and
    # the 40K entries of the small ones (biases, the 10 x 3072 last layer) as values alone: 2.18% of
    # fp32's bytes; the accuracy run's 3 steps are all in the warm-up, at densities 25-22%: about half
    topk = rows["pt/topk:0.01"]
    assert 0.021 < topk["bytes_share"] < 0.0225 and 0.44 < topk["run_bytes_share"] < 0.5, topk
    assert rows["pt/powersgd:4"]["bytes_share"] < 0.005
    assert rows["pt/none"]["points"] == 0 and rows["pt/topk:0.01"]["accuracy"] is not None
    assert rows["pt/topk:0.01"]["accuracies"] == [rows["pt/topk:0.01"]["accuracy"]]   # --quick: seed 0 alone
    assert rows["pt/powersgd:4"]["accuracy"] is None and rows["pt/none"]["accuracy_steps"] == 3
    assert (tmp_path / "compression.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_steadiness_warns_when_an_engines_rounds_spread_widely():
    """The benchmarks say when a run's rounds were too unsteady to judge a few-percent target."""
    from paratrain.bench.gpt_runs import round_spreads, steadiness
    quiet = {"a": [1.00, 1.02, 1.01, 1.03, 1.00], "b": [2.0, 2.1, 2.05, 2.0, 2.02]}
    busy = {"a": [1.00, 1.40, 1.01, 1.25, 1.10], "b": [2.0, 2.6, 2.05, 2.9, 2.02]}
    assert round_spreads(quiet)["a"] == pytest.approx(0.03 / 1.01)
    assert "busy" not in steadiness(quiet)
    line = steadiness(busy)
    assert "busy" in line and "(b)" in line     # b's rounds spread the most: 0.9 / 2.05
    assert steadiness({"a": [1.0]}) is None      # one round says nothing about steadiness


@pytest.mark.quick
@pytest.mark.parametrize("argv", [
    ["compare", "--workers", "0"], ["compare", "--steps", "0"], ["compare", "--batch-size", "-2"],
    ["compare", "--rounds", "0"], ["compare", "--target-loss", "0"], ["plan", "--workers", "0"],
    ["plan", "--top", "0"], ["plan", "--steps", "0"], ["plan", "--memory-gb", "0"],
    ["simulate", "--bucket-mb", "0"], ["simulate", "--stages", "0"], ["simulate", "--microbatches", "0"],
    ["simulate", "--tp", "-1"], ["simulate", "--servers", "0"],
    ["bench", "collectives", "--iters", "0"], ["bench", "collectives", "--warmup", "0"],
    ["bench", "collectives", "--timeout", "0"], ["bench", "data-parallel", "--rounds", "0"],
    ["bench", "parameter-server", "--repeats", "0"], ["bench", "trace", "--steps", "0"],
    ["bench", "elastic", "--kill-step", "0"], ["bench", "compression", "--accuracy-steps", "0"],
    ["run", "--stall-s", "0", "train.py"], ["trace", ".", "--steps", "0"]], ids=" ".join)
def test_a_count_below_one_is_refused_by_the_command_given_it_before_anything_runs(argv, capsys):
    """0 workers, steps, rounds, iterations or seconds is the command's own error, naming the
    option, before a worker starts: not a crash (simulate's bucket of 0 MB divided by zero),
    not the default silently (0 stages or iterations read as none given), not train's error
    for a command the user did not call, not a value the workers meet."""
    from paratrain import cli
    try:
        code = cli.main(argv)
    except SystemExit as e:   # argparse's exit, where the command does not turn it into its return
        code = e.code
    assert code == 2
    value = next(a for a in argv if a in ("0", "-1", "-2"))
    command = " ".join(argv[:2] if argv[0] == "bench" else argv[:1])
    err = capsys.readouterr().err
    assert f"paratrain {command}: error: argument {argv[argv.index(value) - 1]}" in err and f"got {value}" in err
