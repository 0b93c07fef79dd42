"""The parameter-server benchmark runs end to end: real `paratrain train` runs
read back into its tables, JSON and plot. A smoke test of the plumbing with
--quick (few steps), never of speed or loss: nothing here asserts a ratio.
Table 2 (recsys) is left out to save a minute: it goes through the same
``train`` and JSON code as the other two."""
import json

import pytest

from paratrain.bench.parameter_server import QUICK_MODES, SLOWDOWNS, main


@pytest.mark.timeout(240)
def test_quick_parameter_server_benchmark_writes_every_table(tmp_path):
    assert main(["--quick", "--tables", "1,3", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "parameter_server_quick.json").read_text())
    dense = {r["config"]: r for r in data["dense"]}
    assert set(dense) == {"all-reduce", "ps bsp, 1 server", "ps bsp, 2 servers"}
    assert dense["all-reduce"]["vs_allreduce"] == 1.0
    assert all(r["samples_per_s"] > 0 for r in dense.values())
    assert "sparse" not in data
    rows = data["consistency"]
    assert {(r["slowdown"], r["mode"]) for r in rows} == {(s, m) for s, _ in SLOWDOWNS for m in QUICK_MODES}
    for r in rows:
        assert r["final_eval_loss"] > 0 and len(r["shares"]) == 3 and abs(sum(r["shares"]) - 1) < 0.02, r
        if r["mode"] == "bsp":
            assert r["vs_bsp"] == 1.0 and r["loss_vs_bsp"] == 0.0
    png = tmp_path / "parameter_server_quick.png"
    assert data["plot"] == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
