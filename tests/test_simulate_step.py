"""paratrain simulate's data-parallel step against hand-computed cases, its files' checks,
and its command's JSON (paratrain/simulate)."""
import json

import pytest

from paratrain.simulate import command, data_parallel
from paratrain.simulate.collectives import Link, all_reduce
from paratrain.simulate.files import Cluster, Workload, load_cluster, load_workload

MB = 1 << 20
ONE_HOST = Cluster("one host", 1, 8, intra=Link(10e-6, 1e-9), inter=Link(50e-6, 8e-9))
FOUR_HOSTS = Cluster("four hosts", 4, 8, intra=Link(5e-6, 0.1e-9), inter=Link(50e-6, 8e-9))


def workload(params=25 * MB // 4, compute_ms=300.0, fraction=2 / 3):
    return Workload("w", params, 4, 32, compute_ms / 1e3, fraction)


def test_one_bucket_starts_when_backward_ends_so_all_of_it_shows():
    w = workload()   # 25 MB of gradients: one bucket
    s = data_parallel.step(w, ONE_HOST, 4, algorithm="ring")
    ring = all_reduce("ring", 4, 25 * MB).seconds(ONE_HOST.intra)
    assert s.comm_s == pytest.approx(ring) and s.exposed_s == pytest.approx(ring)
    assert s.step_s == pytest.approx(0.3 + ring)
    assert s.efficiency == pytest.approx(0.3 / (0.3 + ring))
    assert s.samples_per_s == pytest.approx(4 * 32 / (0.3 + ring))


def test_buckets_overlap_with_backward_and_only_the_last_shows():
    w = workload(params=100 * MB // 4)   # 4 buckets of 25 MB, ready at 150, 200, 250 and 300 ms; each
    s = data_parallel.step(w, ONE_HOST, 4, algorithm="ring")   # takes ~39 ms here, well inside backward's 50
    one = all_reduce("ring", 4, 25 * MB).seconds(ONE_HOST.intra)
    assert one < 0.05
    assert s.exposed_s == pytest.approx(one)          # the last bucket, ready as backward ends
    assert s.comm_s == pytest.approx(4 * one)
    # a link too slow to keep up: the all-reduces queue, and all but what backward covered shows
    slow = Cluster("slow", 1, 8, intra=Link(10e-6, 10e-9), inter=Link(10e-6, 10e-9))
    s = data_parallel.step(w, slow, 4, algorithm="ring")
    one = all_reduce("ring", 4, 25 * MB).seconds(slow.intra)
    assert s.exposed_s == pytest.approx(0.1 + 0.05 + 4 * one - 0.3)   # first ready at 150 ms, then back to back


def test_one_worker_is_all_compute_and_the_cluster_must_hold_the_workers():
    s = data_parallel.step(workload(), ONE_HOST, 1)
    assert s.efficiency == 1.0 and s.exposed_s == 0.0
    with pytest.raises(ValueError, match="9 workers, but the cluster 'one host' has 8 devices"):
        data_parallel.step(workload(), ONE_HOST, 9)


def test_the_chosen_all_reduce_is_the_cheapest_one():
    assert data_parallel.choose(ONE_HOST, 8, 4 << 10) == "tree"    # small: latency rules
    assert data_parallel.choose(ONE_HOST, 8, 64 * MB) == "ring"    # large: bandwidth rules
    assert data_parallel.choose(FOUR_HOSTS, 32, 64 * MB) == "hierarchical"   # one buffer per host on the wire
    flat = data_parallel.all_reduce_seconds(FOUR_HOSTS, 32, 64 * MB, "ring")
    assert data_parallel.all_reduce_seconds(FOUR_HOSTS, 32, 64 * MB, "hierarchical") < flat


CLUSTER = """name = "test cluster"
nodes = 4
devices_per_node = 8
intra_node_gbps = 100
intra_node_latency_us = 5
inter_node_gbps = 25
inter_node_latency_us = 10
"""
WORKLOAD = """name = "test model"
params = 25_000_000
bytes_per_param = 4
batch_per_device = 64
step_compute_ms = 250
"""


def test_the_files_are_read_and_bad_ones_say_what_is_wrong(tmp_path):
    (tmp_path / "c.toml").write_text(CLUSTER)
    (tmp_path / "w.toml").write_text(WORKLOAD)
    c, w = load_cluster(tmp_path / "c.toml"), load_workload(tmp_path / "w.toml")
    assert c.devices == 32 and c.inter.beta == pytest.approx(8 / 25e9) and c.intra.alpha == pytest.approx(5e-6)
    assert w.gradient_bytes == 100_000_000 and w.step_compute_s == 0.25 and w.backward_fraction == pytest.approx(2 / 3)
    (tmp_path / "bad.toml").write_text(CLUSTER.replace("nodes = 4\n", ""))
    with pytest.raises(ValueError, match="bad.toml: missing key 'nodes'"):
        load_cluster(tmp_path / "bad.toml")
    (tmp_path / "bad.toml").write_text(WORKLOAD.replace("= 250", "= -1"))
    with pytest.raises(ValueError, match="step_compute_ms = -1; give a positive number"):
        load_workload(tmp_path / "bad.toml")
    with pytest.raises(ValueError, match="cannot read"):
        load_workload(tmp_path / "none.toml")
    (tmp_path / "w.toml").write_text(WORKLOAD + "weight_fraction = 0.4\n")
    assert load_workload(tmp_path / "w.toml").weight_fraction == pytest.approx(0.4)
    (tmp_path / "bad.toml").write_text(WORKLOAD + "weight_fraction = 1\n")
    with pytest.raises(ValueError, match="weight_fraction = 1.0; give a share of the backward, between 0 and 1"):
        load_workload(tmp_path / "bad.toml")


def test_the_command_prints_one_row_per_worker_count(tmp_path, capsys):
    (tmp_path / "c.toml").write_text(CLUSTER)
    (tmp_path / "w.toml").write_text(WORKLOAD)
    assert command.main(["--cluster", str(tmp_path / "c.toml"), "--workload", str(tmp_path / "w.toml"),
                         "--workers", "1,8,32", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["workers"] for r in rows] == [1, 8, 32] and rows[0]["efficiency"] == 1.0
    assert all({"strategy", "workers", "step_ms", "samples_per_s", "efficiency"} <= set(r) for r in rows)
    assert rows[0]["efficiency"] >= rows[1]["efficiency"] >= rows[2]["efficiency"] > 0
    assert command.main(["--cluster", str(tmp_path / "c.toml"), "--workload", str(tmp_path / "w.toml"),
                         "--workers", "64"]) == 2
    assert "64 workers, but the cluster 'test cluster' has 32 devices" in capsys.readouterr().err
