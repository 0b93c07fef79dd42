"""The parameter-server benchmark runs end to end: real `paratrain train` runs
read back into its tables, JSON and plot. A smoke test of the plumbing with
--quick (few steps), never of speed or loss: nothing here asserts a ratio.
Table 2 (recsys) is left out to save a minute: it goes through the same
``train`` and JSON code as the other two; so is table 3's second slowdown
(its flags reach ``train`` the same way; test_train_ps runs the straggler)."""
import json

import pytest

from paratrain.bench.parameter_server import QUICK_MODES, SLOWDOWNS, main


@pytest.mark.timeout(240)
def test_quick_parameter_server_benchmark_writes_every_table(tmp_path, monkeypatch):
    from paratrain.bench import parameter_server as bench
    monkeypatch.setattr(bench, "SLOWDOWNS", SLOWDOWNS[:1])   # one slowdown: 2 of table 3's 4 runs, to keep the test short
    assert main(["--quick", "--tables", "1,3", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "parameter_server_quick.json").read_text())
    dense = {r["config"]: r for r in data["dense"]}
    assert set(dense) == {"all-reduce", "ps bsp, 1 server", "ps bsp, 2 servers"}
    assert dense["all-reduce"]["vs_allreduce"] == 1.0
    assert all(r["samples_per_s"] > 0 for r in dense.values())
    assert "sparse" not in data
    rows = data["consistency"]
    assert {(r["slowdown"], r["mode"]) for r in rows} == {(s, m) for s, _ in SLOWDOWNS[:1] for m in QUICK_MODES}
    for r in rows:
        assert r["final_eval_loss"] > 0 and len(r["shares"]) == 3 and abs(sum(r["shares"]) - 1) < 0.02, r
        if r["mode"] == "bsp":
            assert r["vs_bsp"] == 1.0 and r["loss_vs_bsp"] == 0.0
    png = tmp_path / "parameter_server_quick.png"
    assert data["plot"] == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_table_three_repeats_each_mode_and_reports_median_speed_and_mean_loss(monkeypatch):
    """--gpt-repeats N --modes: every selected mode (and bsp, the reference) runs N times,
    alternated; a row's samples/s is the median, its loss the mean against BSP's mean,
    with each run's kept. Driven through table_consistency with the runs faked, so the
    aggregation is checked against numbers worked out here."""
    import statistics

    from paratrain.bench import parameter_server as bench
    calls = []
    fake = {"bsp": ([100.0, 110.0, 90.0], [2.0, 2.0, 2.0]),
            "ssp s=3 +predict": ([150.0, 140.0, 160.0], [2.02, 2.06, 1.98])}

    def train(args, runs, *flags):
        mode = "bsp" if flags[flags.index("--consistency") + 1] == "bsp" else "ssp s=3 +predict"
        slow = flags[-2:]
        i = sum(1 for m, s in calls if m == mode and s == slow)
        calls.append((mode, slow))
        sps, loss = fake[mode][0][i], fake[mode][1][i]
        curve = [(t, loss + 1.0 / (t + 1)) for t in range(40)]
        return {"samples_per_s": sps, "eval_loss": loss, "per_worker": []}, curve

    monkeypatch.setattr(bench, "train", train)
    args = bench.parser().parse_args(["--tables", "3", "--modes", "ssp s=3 +predict", "--gpt-repeats", "3"])
    rows, curves = bench.table_consistency(args, "unused")
    assert [m for m, _ in calls[:4]] == ["bsp", "ssp s=3 +predict"] * 2   # alternated
    assert len(calls) == 3 * 2 * len(bench.SLOWDOWNS) and len(rows) == 2 * len(bench.SLOWDOWNS)
    ssp = next(r for r in rows if r["mode"] == "ssp s=3 +predict")
    assert ssp["runs"] == 3 and ssp["samples_per_s"] == 150.0 and ssp["vs_bsp"] == 1.5
    assert ssp["final_eval_loss"] == pytest.approx(statistics.mean([2.02, 2.06, 1.98]))
    assert ssp["loss_vs_bsp"] == pytest.approx(0.01)
    assert ssp["loss_vs_bsp_runs"] == pytest.approx([0.01, 0.03, -0.01])
    with pytest.raises(SystemExit, match="unknown"):
        bench.selected_modes(bench.parser().parse_args(["--modes", "ssp s=4"]))
