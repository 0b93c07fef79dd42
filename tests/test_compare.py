"""`paratrain compare`: every strategy trains the digits task for the same short budget, and
the table, JSON and plot say what each did (against the runs' own folders and the model's size)."""
import json
import math

import pytest

from paratrain.compare import command
from paratrain.compare.strategies import NAMES
from paratrain.simulate import memory
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
    assert command.main(["--model", "digits", "--workers", "2", "--budget", "0.4s", "--runs", str(tmp_path)]) == 0
    (folder,) = tmp_path.glob("compare-*")
    assert (folder / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| dp |" in (folder / "compare.md").read_text() and "predicted step" in (folder / "compare.md").read_text()
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
