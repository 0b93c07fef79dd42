"""`paratrain plan`: the layouts a worker count allows, each predicted by the cost model and
ranked, with the `paratrain train` command for each (in-process: nothing is launched)."""
import json

from paratrain.simulate import memory, plan

CALIBRATION = {"links": {"shm_direct": {"alpha": 2e-5, "beta": 2e-10, "gamma": 4e-10}}}


def test_the_layouts_of_4_workers():
    got = {(l.strategy, l.dp, l.pp, l.tp, l.microbatches) for l in plan.layouts(4, layers=4)}
    assert {("dp", 4, 1, 1, None), ("zero3", 4, 1, 1, None), ("tensor", 2, 1, 2, None), ("tensor", 1, 1, 4, None),
            ("pipeline", 2, 2, 1, 4), ("pipeline", 1, 4, 1, 8), ("pipeline-zb", 2, 2, 1, 8)} <= got
    assert not any(l.pp == 4 for l in plan.layouts(4, layers=3))   # a stage needs a layer
    assert {l.strategy for l in plan.layouts(3)} >= {"pipeline", "tensor"} and \
        not any(l.pp == 2 for l in plan.layouts(3))                # 2 does not divide 3


def test_zero_s_state_is_the_papers():
    P = 1000
    assert memory.state_bytes("dp", P, memory.ADAM, 4) == 16 * P
    assert memory.state_bytes("zero1", P, memory.ADAM, 4) == 8 * P + 8 * P / 4
    assert memory.state_bytes("zero2", P, memory.ADAM, 4) == 4 * P + 12 * P / 4
    assert memory.state_bytes("zero3", P, memory.ADAM, 4) == 16 * P / 4
    assert memory.state_bytes("pipeline", P, memory.ADAM, 4, pp=2) == 8 * P
    assert memory.state_bytes("topk", P, memory.SGD_MOMENTUM, 2) == 16 * P


def test_plan_ranks_what_runs_and_says_why_the_rest_does_not(tmp_path, capsys):
    (tmp_path / "c.json").write_text(json.dumps(CALIBRATION))
    assert plan.main(["--model", "mlp", "--workers", "2", "--calibration", str(tmp_path / "c.json"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["layouts"]
    rates = [r["predicted_samples_per_s"] for r in rows]
    assert rates == sorted(rates, reverse=True) and len(rows) >= 10
    assert all(r["command"].startswith("paratrain train --model mlp --workers 2 --strategy ") for r in rows)
    assert all(r["predicted_memory_mb"] > 0 for r in rows)
    assert {r["strategy"] for r in rows} >= {"dp", "zero1", "zero3", "pipeline", "ps-bsp", "topk"}
    assert any(r["strategy"] == "tensor" and "--tp cuts a transformer" in r["why"] for r in out["rejected"])
    zero3 = next(r for r in rows if r["strategy"] == "zero3")
    dp = next(r for r in rows if r["strategy"] == "dp")
    assert zero3["predicted_memory_mb"] < dp["predicted_memory_mb"]
    # a memory cap drops what would not fit
    cap = (dp["predicted_memory_mb"] + zero3["predicted_memory_mb"]) / 2 / 1024
    assert plan.main(["--model", "mlp", "--workers", "2", "--calibration", str(tmp_path / "c.json"),
                      "--memory-gb", str(cap), "--json"]) == 0
    kept = json.loads(capsys.readouterr().out)["layouts"]
    assert "dp" not in {r["strategy"] for r in kept} and "zero3" in {r["strategy"] for r in kept}


def test_plan_without_a_calibration_says_what_to_run(tmp_path, capsys):
    assert plan.main(["--model", "mlp", "--calibration", str(tmp_path / "none.json")]) == 2
    assert "paratrain simulate --calibrate" in capsys.readouterr().err

