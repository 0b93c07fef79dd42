"""`paratrain compare`: every strategy trains the digits task for the same short budget, and
the table, JSON and plot say what each did (against the runs' own folders and the model's size)."""
import json
import math

import pytest

from paratrain.compare import command, report
from paratrain.compare.strategies import NAMES
from paratrain.simulate import memory, timing
from paratrain.train.metrics import read_metrics


def _digits_bytes():
    from paratrain.train.tasks import build_task
    return sum(p.numel() * 4 for p in build_task("digits").model.parameters())


@pytest.mark.timeout(240)
def test_compare_runs_every_strategy_for_the_budget_and_writes_the_three_files(tmp_path, capsys, monkeypatch):
    config = tmp_path / "config"      # a calibration of this machine's links: each row gets a prediction too
    (config / "paratrain").mkdir(parents=True)
    (config / "paratrain" / "calibration.json").write_text(
        json.dumps({"links": {"shm_direct": {"alpha": 2e-5, "beta": 2e-10, "gamma": 4e-10}}}))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(config))
    monkeypatch.setattr(timing, "PART_TIMINGS", 1)   # each part timed once: this checks what is predicted
    assert command.main(["--model", "digits", "--workers", "2", "--budget", "0.4s", "--runs", str(tmp_path)]) == 0
    (folder,) = tmp_path.glob("compare-*")
    assert (folder / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (folder / "compare.md").read_text()
    assert "| dp |" in table and "predicted step" in table and table.count(" (before ") == len(NAMES) - 1
    assert "at one pace" in table
    rows = {r["strategy"]: r for r in json.loads((folder / "compare.json").read_text())["rows"]}
    assert list(rows) == list(NAMES)
    assert "not digits" in rows["tensor"]["unavailable"]   # train's own reason: --tp cuts transformers
    ran = {name: r for name, r in rows.items() if "unavailable" not in r}
    assert set(ran) == set(NAMES) - {"tensor"}, {n: r.get("unavailable") for n, r in rows.items()}
    n = _digits_bytes()
    for name, r in ran.items():
        summary = json.loads((folder / r["run_dir"].split("/")[-1] / "summary.json").read_text())
        assert r["samples_per_s"] == summary["samples_per_s"] > 0 and math.isfinite(r["loss"]) and r["step_ms"] > 0
        assert r["peak_memory_mb"] > 0 and r["predicted_step_ms"] > 0
        before, after = r["predicted_before_after_ms"]   # timed just before the run and just after
        assert before > 0 and after > 0 and r["predicted_step_ms"] == pytest.approx((before + after) / 2)
        assert r["pace_ms"] > 0 and r["whole_steps_per_compute"] > 0 and r["samples_per_s_at_pace"] > 0
        parts = r["predicted_parts_ms"]   # the model's step in parts: they add up to it
        assert parts["compute"] > 0 and sum(parts.values()) == pytest.approx(r["predicted_step_ms"])
        assert 0 < r["compute_ms"] < r["step_ms"], (name, r)   # rank 0 computes inside its step
        # and again at the speed the run computed at
        assert r["predicted_from_run_compute_ms"] > 0 and r["run_compute_speed"] > 0, name
        means = [w["compute_s"] / w["batches"] for w in summary["per_worker"]]
        assert r["slowest_compute_ratio"] == pytest.approx(max(means) / means[0]) and r["slowest_compute_ratio"] >= 1
        assert r["mean_compute_ratio"] == pytest.approx(sum(means) / 2 / means[0])
        taken = [p["batches"] for p in summary["per_worker"]]
        if name not in ("ps-asp", "ps-ssp"):   # lockstep: the budget's stop was agreed, the same step for all
            assert taken == [summary["steps"]] * 2, (name, taken, summary["steps"])
    # what each sends a step, against the model's n bytes of gradients
    assert ran["dp"]["bytes_per_step"] == ran["dp-naive"]["bytes_per_step"] == n
    for stage in ("zero1", "zero2"):
        assert 2 * n <= ran[stage]["bytes_per_step"] <= 2.01 * n
    assert ran["zero3"]["bytes_per_step"] >= 3 * n
    # top-k's density warms up from 25% (DGC): 8 bytes an entry sent, half of n at first, falling
    # step by step; a short budget may end inside the warm-up, so the mean depends on the steps taken
    topk = [m["bytes"] for m in read_metrics(ran["topk"]["run_dir"] + "/metrics.jsonl")]
    assert topk[0] <= 0.51 * n and all(b <= a for a, b in zip(topk, topk[1:])) and topk[-1] < topk[0]
    assert ran["topk"]["bytes_per_step"] < 0.51 * n and ran["powersgd"]["bytes_per_step"] < 0.2 * n
    # plan's state formula (ZeRO's paper) against the bytes pt.ZeRO held (SGD with momentum: K = 4)
    for stage in (1, 2, 3):
        summary = json.loads((folder / ran[f"zero{stage}"]["run_dir"].split("/")[-1] / "summary.json").read_text())
        held = sum(summary["zero_bytes_per_worker"].values())
        assert abs(held - memory.state_bytes(f"zero{stage}", n / 4, memory.SGD_MOMENTUM, 2)) <= 0.05 * held
    out = capsys.readouterr().out
    assert "wrote" in out and "compare.png" in out


def test_a_run_s_spread_is_taken_from_step_to_step_leaving_out_the_host_s_drift():
    """A run whose steps drift (the host slowing over it) and jitter about the drift: the
    spread compare gives the model is the jitter's, not the drift's; and so is the spread
    of the steps timed for a prediction."""
    import numpy as np

    from paratrain.simulate import timing, waits
    rng = np.random.default_rng(0)
    jitter = rng.normal(0, 1.0, 400)
    steps = list(100 + 0.05 * np.arange(400) + jitter)   # 20 units of drift across the run
    assert np.std(steps) > 5   # the plain standard deviation is mostly the drift
    assert waits.step_to_step_spread(steps) == pytest.approx(np.std(jitter), rel=0.1)
    assert waits.step_to_step_spread([1.0, 3.0, 1.0, 3.0]) == pytest.approx(np.sqrt(2))   # (3 x 2^2) / (2 x 3)
    assert waits.step_to_step_spread([5.0]) == 0.0
    timed = timing.Timed(steps)
    assert timed == pytest.approx(np.median(steps)) and timed.jitter == waits.step_to_step_spread(steps)


def test_the_table_names_the_runs_across_which_the_host_moved():
    """A run whose prediction's two timings (before it, after it) are more than 10% apart was
    predicted and measured at different speeds of this host: the table says which, and how
    to measure them again."""

    def row(name, before, after):
        return {"strategy": name, "samples_per_s": 100.0, "step_ms": 150.0, "bytes_per_step": 1, "loss": 1.0,
                "peak_memory_mb": 1.0, "predicted_step_ms": (before + after) / 2,
                "predicted_before_after_ms": [before, after]}
    rows = [row("dp", 140.0, 150.0), row("ps-bsp", 170.0, 126.0), row("zero1", 100.0, 110.5),
            {"strategy": "tensor", "unavailable": "not digits"}]
    assert report.host_moved(rows) == [("ps-bsp", pytest.approx(44 / 126)), ("zero1", pytest.approx(0.105))]
    table = report.markdown(rows, "gpt")
    assert "| dp | 100 | 150.0 ms | 145.0 ms (before 140.0, after 150.0) |" in table
    rows[0].update(predicted_from_run_compute_ms=148.25, run_compute_speed=1.1)   # a column where a row has one
    table = report.markdown(rows, "gpt")
    assert "| predicted step | predicted from its compute |" in table
    assert "| dp | 100 | 150.0 ms | 145.0 ms (before 140.0, after 150.0) | 148.2 ms (x1.10) |" in table
    assert "| ps-bsp | 100 | 150.0 ms | 148.0 ms (before 170.0, after 126.0) | - |" in table
    assert "across the runs of ps-bsp (34.9%), zero1 (10.5%)" in table and "`--strategies ps-bsp,zero1`" in table
    # dp 145/150 and ps-bsp 148/150 within 10% as timed, zero1 105.25/150 not; dp's 148.25 from its compute
    assert "within 10% of the measured: 2 of 3 as timed, 1 of 3 from their compute." in table
    assert "moved" not in report.markdown(rows[:1], "gpt")


def test_combinations_are_every_dp_pp_tp_of_the_workers_with_two_above_one():
    from paratrain.compare.strategies import combination, combinations, parse_names, train_flags
    from paratrain.simulate import plan
    assert combinations(2) == [] and sorted(combinations(4)) == ["dp2-pp2", "dp2-tp2", "pp2-tp2"]
    assert "dp2-pp2-tp2" in combinations(8) and len(combinations(8)) == 7
    assert all(math.prod(combination(n)) == 8 for n in combinations(8))
    assert parse_names("all", 4) == [*NAMES, *combinations(4)] and parse_names("all") == list(NAMES)
    assert parse_names("pp2-tp2,dp") == ["pp2-tp2", "dp"]
    for bad in ("pp2", "dp2x", "tp2-pp2"):   # one factor alone is a name of its own; the order is dp, pp, tp
        with pytest.raises(ValueError, match="a combination such as dp2-pp2"):
            parse_names(bad)
    assert train_flags("pp2-tp2", 4) == ["--strategy", "pipeline", "--stages", "2", "--tp", "2", "--dp", "1"]
    layout = plan.compare_layout("dp2-pp2", 4)   # predicted as the pipeline it runs: 1F1B, 4 micro-batches
    assert (layout.strategy, layout.dp, layout.pp, layout.tp, layout.microbatches) == ("pipeline", 2, 2, 1, 4)


@pytest.mark.timeout(180)
def test_compare_runs_the_combinations_it_is_given_and_says_why_not_for_the_rest(tmp_path, monkeypatch):
    """digits on 4 workers: 2 replicas of a 2-stage pipeline run; a tensor cut of a CNN and
    a layout of 8 workers are listed with train's reasons."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "none"))   # no calibration: no predictions
    assert command.main(["--model", "digits", "--workers", "4", "--strategies", "dp2-pp2,dp2-tp2,dp2-pp2-tp2",
                         "--steps", "2", "--rounds", "2", "--runs", str(tmp_path)]) == 0
    (folder,) = tmp_path.glob("compare-*")
    rows = json.loads((folder / "compare.json").read_text())["rows"]
    assert [r["strategy"] for r in rows] == ["dp2-pp2", "dp2-tp2", "dp2-pp2-tp2"]
    summary = json.loads((folder / rows[0]["run_dir"].split("/")[-1] / "summary.json").read_text())
    assert (summary["pipeline_stages"], summary["pipeline_replicas"], summary["steps"]) == (2, 2, 2), summary
    assert rows[0]["samples_per_s"] > 0 and math.isfinite(rows[0]["loss"]) and "predicted_step_ms" not in rows[0]
    assert "not digits" in rows[1]["unavailable"] and "2 x 2 x 2 = 8" in rows[2]["unavailable"]
    # --rounds 2: two runs of their own, each logged; the row is the slower one (the lower middle)
    first, second = rows[0]["rounds"]
    assert first["run_dir"] != second["run_dir"] and rows[0]["run_dir"] in (first["run_dir"], second["run_dir"])
    speeds = sorted(r["samples_per_s"] for r in (first, second))
    assert rows[0]["samples_per_s"] == speeds[0] and rows[0]["samples_per_s_range"] == speeds
    assert (folder / "logs" / "dp2-pp2.1.log").exists() and (folder / "logs" / "dp2-pp2.2.log").exists()
    assert "ran 2 times" in (folder / "compare.md").read_text()


def test_rounds_alternate_the_order_and_a_strategy_shows_its_median_run():
    """Every other round runs the list backwards, so over two rounds each strategy sits as
    early on average as the others; the row is the median run's own, whole, with every run's
    figures beside it; a failed run is listed, not counted."""
    assert command.round_order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert command.round_order(["a", "b", "c"], 1) == ["c", "b", "a"]
    positions = {n: sum(command.round_order("abc", r).index(n) for r in (0, 1)) for n in "abc"}
    assert len(set(positions.values())) == 1
    runs = [{"strategy": "dp", "samples_per_s": s, "step_ms": 1e3 / s, "loss": 9 - i, "run_dir": f"run{i}",
             "bytes_per_step": 1, "peak_memory_mb": 5}
            for i, s in enumerate((300.0, 360.0, 330.0))] + [{"strategy": "dp", "unavailable": "the run failed"}]
    row = report.median_run(runs)
    assert (row["samples_per_s"], row["loss"], row["run_dir"]) == (330.0, 7, "run2")   # one run's, all of it
    assert row["samples_per_s_range"] == [300.0, 360.0]
    assert [r.get("samples_per_s") for r in row["rounds"]] == [300.0, 360.0, 330.0, None]
    assert row["rounds"][3] == {"unavailable": "the run failed"}
    assert report.median_run(runs[:1]) == runs[0]   # one round: the run as it was
    assert "330 (300-360)" in report.markdown([row], "t") and "ran 4 times" in report.markdown([row], "t")



def test_runs_at_one_pace_are_their_samples_per_s_at_the_median_pace_of_all_runs():
    """A run while the host computed slower (its pace: its compute a step, in the model's whole
    steps, longer) is shown as fast as it would have run at the median pace: samples/s x
    pace / median."""
    def run(name, speed, **pace):
        return {"strategy": name, "samples_per_s": speed, "step_ms": 1, "loss": 1, "bytes_per_step": 1,
                "peak_memory_mb": 5, "run_dir": f"{name}-{speed}", **pace}
    runs = [run("dp", 300.0, pace_ms=120.0), run("dp", 380.0, pace_ms=100.0), run("zero1", 330.0, pace_ms=90.0),
            run("zero1", 340.0, pace_ms=100.0), {"strategy": "zero1", "unavailable": "the run failed"},
            run("tensor", 200.0)]   # no prediction, no pace
    report.at_one_pace(runs)   # the median pace of the four: 100 ms
    assert [r.get("samples_per_s_at_pace") for r in runs] == [pytest.approx(360.0), 380.0, pytest.approx(297.0),
                                                              340.0, None, None]
    dp, zero1 = report.median_run(runs[:2]), report.median_run(runs[2:5])
    assert dp["samples_per_s"] == 300.0 and dp["samples_per_s_at_pace"] == pytest.approx(370.0)   # of both runs
    assert zero1["samples_per_s_at_pace"] == pytest.approx(318.5)
    assert [r.get("pace_ms") for r in zero1["rounds"]] == [90.0, 100.0, None]
    table = report.markdown([dp, zero1], "t")
    assert "| dp | 300 (300-380) | 370 |" in table and "Fastest: zero1 as run, dp at one pace." in table
    report.at_one_pace(runs[5:])   # no paces: nothing to bring to one
    assert "samples_per_s_at_pace" not in runs[5] and "at one pace" not in report.markdown(runs[5:], "t")


def test_a_strategys_runs_share_the_median_of_their_compute_to_pace_ratios():
    """Two pipeline runs whose workers computed equally fast are at one pace, though the model's
    timing beside each said a stage is worth 2.0 and 1.5 of the whole step (a stage's timing
    moves): each gets the median ratio, 1.75, and their paces differ only by their compute."""
    runs = [{"strategy": "pipeline", "samples_per_s": 200.0, "pace_ms": 200.0, "whole_steps_per_compute": 2.0},
            {"strategy": "pipeline", "samples_per_s": 220.0, "pace_ms": 150.0, "whole_steps_per_compute": 1.5},
            {"strategy": "dp", "samples_per_s": 350.0, "pace_ms": 175.0, "whole_steps_per_compute": 1.0}]
    report.at_one_pace(runs)   # both pipeline runs computed 100 ms a step: 175 ms of the whole step each
    assert [r["samples_per_s_at_pace"] for r in runs] == [pytest.approx(200.0), pytest.approx(220.0), 350.0]
    runs[1]["pace_ms"] = 165.0   # this one computed 10% slower: shown 10% faster
    report.at_one_pace(runs)
    assert runs[1]["samples_per_s_at_pace"] == pytest.approx(220.0 * 1.1)   # the median pace still 175
