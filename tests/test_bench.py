"""The collectives benchmark runs end to end and reports every engine and collective.

A smoke test of the plumbing (launch, interleaved timing, checks, JSON, plot),
never of speed: on a shared 2-core machine timings say nothing, so nothing
here asserts on a time or a ratio. Open MPI is measured when mpirun and mpi4py
are installed and left out otherwise; the JSON says which.
"""
import json

import pytest

from paratrain.bench.cases import COLLECTIVES
from paratrain.bench.collectives import main


@pytest.mark.timeout(180)
def test_quick_benchmark_reports_every_engine_and_collective(tmp_path):
    code = main(["--quick", "-n", "2", "--sizes", "4K,64K", "--collectives", ",".join(COLLECTIVES),
                 "--out", str(tmp_path)])
    assert code == 0

    data = json.loads((tmp_path / "collectives.json").read_text())
    engines = data["config"]["engines"]
    assert engines[:2] == ["paratrain", "gloo"]
    assert ("mpi" in engines) == (data["environment"]["launcher"] == "mpirun")
    assert data["environment"]["world_size"] == 2
    for key in ("torch", "cpu_count", "date"):
        assert data["environment"][key]

    got = {(r["collective"], r["engine"], r["bytes"]): r for r in data["results"]}
    for coll in COLLECTIVES:
        for engine in engines:
            for size in (4096, 65536):
                r = got[(coll, engine, size)]
                assert r["verified"], r
                assert r["iters"] == len(r["samples_us"]) > 0
                assert r["calls"] == 10   # small sizes: back-to-back calls per timed turn
                assert r["median_us"] > 0 and r["algbw_GBps"] > 0 and r["busbw_GBps"] > 0
    assert {(r["collective"], r["bytes"]) for r in data["ratios"]} == {(c, s) for c in COLLECTIVES
                                                                          for s in (4096, 65536)}
    png = tmp_path / "collectives.png"
    assert png.stat().st_size > 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(180)
def test_quick_benchmark_with_shared_buffers_extra_algorithms_and_the_hierarchical_run(tmp_path):
    """--buffers shared, --algorithms and --hierarchical reach the JSON: each extra
    engine measured and its result checked against numpy like the others."""
    code = main(["--quick", "-n", "2", "--sizes", "4K,64K", "--collectives", "all_reduce,all_gather",
                 "--buffers", "shared", "--algorithms", "ring,tree", "--hierarchical", "--no-mpi",
                 "--out", str(tmp_path)])
    assert code == 0
    data = json.loads((tmp_path / "collectives.json").read_text())
    assert data["config"]["buffers"] == "shared" and data["config"]["hierarchical"] is True
    engines = {(r["engine"], r["run"]) for r in data["results"]}
    assert {("paratrain", "main"), ("paratrain/ring", "main"), ("paratrain/tree", "main"), ("gloo", "main"),
            ("paratrain-hier", "hierarchical")} <= engines, engines
    for r in data["results"]:
        assert r["verified"] and r["median_us"] > 0, r
    assert {r["collective"] for r in data["results"] if r["engine"] == "paratrain/ring"} == {"all_reduce"}
