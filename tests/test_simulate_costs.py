"""The cost model's formulas against hand-computed cases, and calibration recovering known
constants from synthetic timings (paratrain/simulate)."""
import json
import os
import subprocess

import numpy as np
import pytest

from paratrain.simulate import calibrate
from paratrain.simulate.collectives import (Link, Terms, all_gather, all_reduce, broadcast,
                                            hierarchical_all_reduce, reduce_scatter)

MB = 1 << 20


def test_ring_all_reduce_by_hand():
    # 4 ranks, 8 MB: 6 steps; each rank sends 3/4 of the buffer twice and reduces 3/4 of it once
    assert all_reduce("ring", 4, 8 * MB) == Terms(6, 12 * MB, 6 * MB)
    link = Link(alpha=10e-6, beta=1e-9, gamma=0.5e-9)
    assert all_reduce("ring", 4, 8 * MB).seconds(link) == pytest.approx(6 * 10e-6 + 12 * MB * 1e-9 + 6 * MB * 0.5e-9)
    assert all_reduce("ring", 1, MB) == Terms(0, 0, 0)


def test_tree_all_reduce_by_hand():
    # a power of two: log2 P steps of the whole buffer; 6 ranks: 2 steps among 4, plus fold in and back
    assert all_reduce("tree", 8, MB) == Terms(3, 3 * MB, 3 * MB)
    assert all_reduce("tree", 6, MB) == Terms(4, 4 * MB, 3 * MB)
    assert all_reduce("tree", 2, MB) == Terms(1, MB, MB)


def test_naive_direct_and_the_other_collectives_by_hand():
    assert all_reduce("naive", 3, MB) == Terms(4, 4 * MB, 2 * MB)   # the root: 2 receives, 2 sends
    # shared memory, 2 ranks, 3 MB in 1 MB rounds: 4 barriers; half copied in and out, a half copied
    # back, the whole read to reduce; 256 KB: copied in whole, one barrier, both inputs reduced by each
    assert all_reduce("direct", 2, 3 * MB) == Terms(4, 4.5 * MB, 3 * MB)
    assert all_reduce("direct", 2, MB // 4) == Terms(1, MB // 4, MB // 2)
    assert all_gather(4, 4 * MB) == Terms(3, 3 * MB)
    assert reduce_scatter(4, 4 * MB) == Terms(3, 3 * MB, 3 * MB)
    assert broadcast(5, MB) == Terms(3, 3 * MB)
    with pytest.raises(ValueError, match="no cost model for all_reduce algorithm 'bogus'"):
        all_reduce("bogus", 2, MB)


def test_a_hierarchical_all_reduce_sends_one_buffer_per_host_over_the_network():
    intra, inter = Link(1e-6, 0.1e-9), Link(50e-6, 8e-9)   # memory, and a 1 Gbit/s network
    n, hosts, per_host = 16 * MB, 4, 8
    # reduce to the leader (the direct all-reduce: 16 rounds of 1 MiB, one barrier each and one
    # more; 2 7/8 + 1/8 of n copied), then the direct broadcast (16 barriers; n copied in, the
    # copies out overlapping it but for the last round's)
    inside = 17 * 1e-6 + (2 * 7 / 8 + 1 / 8) * n * 0.1e-9 + 16 * 1e-6 + (n + n / 16) * 0.1e-9
    network = 6 * 50e-6 + 2 * 3 / 4 * n * 8e-9                  # a ring of the 4 leaders
    assert hierarchical_all_reduce(hosts, per_host, n, intra, inter) == pytest.approx(inside + network)
    flat = all_reduce("ring", hosts * per_host, n).seconds(inter)   # every rank on the network
    assert hierarchical_all_reduce(hosts, per_host, n, intra, inter) < flat


def test_link_from_rates():
    link = Link.from_rates(gbps=10, latency_us=20, reduce_gbps=80)
    assert link.alpha == pytest.approx(20e-6) and link.beta == pytest.approx(0.8e-9)
    assert link.gamma == pytest.approx(0.1e-9)


def test_calibration_recovers_known_constants_from_synthetic_timings():
    true = Link(alpha=25e-6, beta=0.8e-9, gamma=0.3e-9)
    rng = np.random.default_rng(0)
    samples = []
    for algorithm in ("ring", "tree"):   # two shares of reduced to sent bytes: gamma is told from beta
        for P in (2, 3, 4):
            for n in (4 << 10, 64 << 10, MB, 16 * MB, 64 * MB):
                t = all_reduce(algorithm, P, n).seconds(true) * (1 + 0.01 * rng.standard_normal())
                samples.append((algorithm, P, n, t))
    got, k = calibrate.fit(samples)
    assert k == 1.0
    assert got.alpha == pytest.approx(true.alpha, rel=0.05)
    assert got.beta == pytest.approx(true.beta, rel=0.05)
    assert got.gamma == pytest.approx(true.gamma, rel=0.15)
    assert np.abs(calibrate.relative_errors(got, samples)).max() < 0.05


def test_calibration_keeps_constants_non_negative_where_one_algorithm_cannot_tell_them_apart():
    true = Link(alpha=10e-6, beta=1e-9)
    samples = [("ring", P, n, all_reduce("ring", P, n).seconds(true)) for P in (2, 4) for n in (MB, 8 * MB, 64 << 10)]
    got, _ = calibrate.fit(samples)
    assert min(got.alpha, got.beta, got.gamma) >= 0
    assert np.abs(calibrate.relative_errors(got, samples)).max() < 1e-6   # beta and gamma share the bytes
    with pytest.raises(ValueError, match="at least two measurements"):
        calibrate.fit(samples[:1])


def test_calibration_recovers_how_ranks_sharing_cores_slow_each_other():
    """Ranks on 2 cores taking ceil(P/2) (P/2)^(k-1) the time of ranks with a core each, as
    many as work at once: recursive doubling at 3 ranks folds the third in, and it waits
    while two exchange; the ring keeps all 3 at work. The fit finds the exponent and the
    constants of one core."""
    from paratrain.simulate.collectives import busy_ranks
    assert busy_ranks("tree", 3) == 2 and busy_ranks("tree", 4) == 4 and busy_ranks("ring", 3) == 3
    true = Link(alpha=20e-6, beta=0.5e-9, gamma=0.2e-9)
    samples = [(a, P, n, all_reduce(a, P, n).seconds(true) * calibrate.oversubscribed(busy_ranks(a, P), 2, 2.0))
               for a in ("ring", "tree") for P in (2, 3, 4) for n in (64 << 10, MB, 16 * MB)]
    got, k = calibrate.fit(samples, cores=2)
    assert k == 2.0 and got.beta == pytest.approx(true.beta, rel=0.01)
    assert np.abs(calibrate.relative_errors(got, samples, 2, k)).max() < 1e-6


def test_a_bench_report_becomes_samples_by_link():
    report = {"config": {"nproc": 3}, "results": [
        {"collective": "all_reduce", "engine": "paratrain", "bytes": MB, "median_us": 500.0, "run": "main"},
        {"collective": "all_reduce", "engine": "paratrain/ring", "bytes": MB, "median_us": 900.0, "run": "main"},
        {"collective": "all_reduce", "engine": "gloo", "bytes": MB, "median_us": 2000.0, "run": "main"},
        {"collective": "all_reduce", "engine": "paratrain-hier", "bytes": MB, "median_us": 3000.0,
         "run": "hierarchical"},
        {"collective": "all_gather", "engine": "paratrain", "bytes": MB, "median_us": 300.0, "run": "main"}]}
    assert calibrate.samples_from_bench(report) == {"shm_direct": [("direct", 3, MB, 500e-6)],
                                                    "shm": [("ring", 3, MB, 900e-6)],
                                                    "net": [("ring", 3, MB, 2000e-6)],
                                                    "hierarchical": [("hierarchical", 3, MB, 3000e-6)]}


def test_a_pretend_link_is_measured_in_a_limited_namespace_and_carries_to_the_hierarchical_backend():
    """The link's fit comes from Gloo between two pretend hosts; the hierarchical backend at
    2 x 2 ranks is then predicted from it and the host's shm link, with no fitting."""
    from paratrain.launch import link
    if link.check("1gbit"):
        pytest.skip(link.check("1gbit"))
    intra, net = Link(5e-6, 0.2e-9, 0.1e-9, MB, 0.1e-9), Link(60e-6, 16e-9, 0.3e-9)
    sizes = (256 << 10, MB, 4 * MB, 16 * MB)
    commands = []

    def bench(cmd, **_):   # what `paratrain bench collectives` would write, from the model
        commands.append(cmd)
        P, out = int(cmd[cmd.index("-n", 2) + 1]), cmd[cmd.index("--out") + 1]
        if "--hierarchical" in cmd:
            rows = [{"engine": "paratrain-hier", "run": "hierarchical", "bytes": n,
                     "median_us": calibrate.hierarchical_seconds(P, n, intra, net, 2, 2.0) * 1e6} for n in sizes]
        else:
            rows = [{"engine": "gloo", "run": "main", "bytes": n,
                     "median_us": all_reduce("ring", P, n).seconds(net) * 1e6} for n in sizes]
        os.makedirs(out)
        with open(os.path.join(out, "collectives.json"), "w") as f:
            json.dump({"config": {"nproc": P}, "results": [dict(r, collective="all_reduce") for r in rows]}, f)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    got = calibrate.measure_link("1gbit", runner=bench)
    assert all(cmd[:2] == [link.tool("unshare"), "-n"] and "1gbit" in cmd and "--interleave-sizes" in cmd
               for cmd in commands)
    assert [("--hierarchical" in c, c[c.index("-n", 2) + 1]) for c in commands] == [(False, "2"), (True, "4")]
    fitted = calibrate.fit_network(got["net"])
    errors = calibrate.link_errors(got, fitted, intra, 2, 2.0)
    assert np.abs(errors["net"]).max() < 1e-6 and len(errors["hierarchical"]) == 4
    assert np.abs(errors["hierarchical"]).max() < 1e-6
    # the shm phases count: with every rank on the memory link for free, 16 MiB is under-predicted
    free = Link(0.0, 0.0)
    assert calibrate.link_errors(got, fitted, free, 2, 2.0)["hierarchical"][-1] < -0.01


def test_a_network_link_fit_finds_the_floor_a_rate_limited_link_puts_under_small_calls():
    """A token bucket lets a small call through at the pace of the path under it and a large
    one at its rate: a call takes the slower of the two. fit_network recovers the floor and
    the line above it, which one line misfits by more than 10%; without a floor in the
    samples it fits a line, as fit does."""
    limited = Link(alpha=100e-6, beta=1.6e-9, floor=2e-3)
    sizes = [(64 << 10) << i for i in range(9)]
    samples = [("ring", 2, n, all_reduce("ring", 2, n).seconds(limited)) for n in sizes]
    assert samples[0][-1] == pytest.approx(2e-3) and samples[-1][-1] > 2e-3
    got = calibrate.fit_network(samples)
    assert got.floor == pytest.approx(2e-3, rel=1e-6) and got.beta == pytest.approx(1.6e-9, rel=1e-6)
    assert np.abs(calibrate.relative_errors(got, samples)).max() < 1e-6
    line, _ = calibrate.fit(samples, caches=(0,))
    assert np.abs(calibrate.relative_errors(line, samples)).max() > 0.1
    plain = [("ring", 2, n, all_reduce("ring", 2, n).seconds(Link(100e-6, 1.6e-9))) for n in sizes]
    assert calibrate.fit_network(plain).floor == 0.0
    assert all_reduce("ring", 1, MB).seconds(limited) == 0.0   # no call, no floor


def test_a_size_held_out_is_predicted_from_the_others():
    true = Link(alpha=20e-6, beta=0.5e-9, gamma=0.2e-9, cache_bytes=MB, beyond=0.3e-9)
    sizes = [(64 << 10) << i for i in range(9)]   # 64 KiB to 16 MiB, as --calibrate times them
    samples = [(a, P, n, all_reduce(a, P, n).seconds(true)) for a in ("ring", "tree") for P in (2, 4) for n in sizes]
    assert len(calibrate.held_out_errors(samples)) == 5 * 4               # 1 to 16 MiB, held out in turn
    assert max(calibrate.held_out_errors(samples)) < 1e-6                # the model is the truth: exact
    bent = [(a, P, n, t * (1.5 if n == 4 * MB else 1.0)) for a, P, n, t in samples]
    assert max(calibrate.held_out_errors(bent)) > 0.3                    # 4 MiB 1.5x slower than the model
    assert calibrate.held_out_errors([s for s in samples if s[2] >= 4 * MB]) is None   # 3 sizes: none to spare


def test_ranks_on_their_own_cores_and_ranks_sharing_them_are_fitted_as_two_links():
    """2 ranks on 2 cores spin; 3 and 4 hand off through the scheduler: two links. The fit
    splits the samples at the cores and recovers each, where one link for all misses."""
    from paratrain.simulate.collectives import busy_ranks
    own, crowded = Link(10e-6, 0.2e-9, 0.1e-9), Link(60e-6, 0.5e-9, 0.3e-9)

    def seconds(a, P, n):
        if P <= 2:
            return all_reduce(a, P, n).seconds(own)
        return all_reduce(a, P, n).seconds(crowded.slowed(calibrate.oversubscribed(busy_ranks(a, P), 2, 1.5)))
    samples = [(a, P, n, seconds(a, P, n)) for a in ("ring", "tree") for P in (2, 3, 4)
               for n in (64 << 10, MB, 4 * MB, 16 * MB)]
    split = calibrate.by_regime({"shm": samples}, 2)
    assert sorted(split) == ["shm", "shm_crowded"] and {s[1] for s in split["shm"]} == {2}
    assert calibrate.by_regime({"shm": samples}, 4) == {"shm": samples}   # a core each: one link
    links = calibrate.fit_links({"shm": samples}, 2)
    for name in links:
        link, k = links[name]
        assert np.abs(calibrate.relative_errors(link, split[name], 2, k)).max() < 1e-6, name
    assert links["shm_crowded"][1] == 1.5
    assert calibrate.link_for_ranks(links, "shm", 2, 2) == "shm"
    assert calibrate.link_for_ranks(links, "shm", 4, 2) == "shm_crowded"
    assert calibrate.link_for_ranks({"net": None}, "net", 4, 2) == "net"   # no crowded link fitted
    joint, k = calibrate.fit(samples, 2)
    assert np.abs(calibrate.relative_errors(joint, samples, 2, k)).max() > 0.1
    # a cluster with both: its own link while each rank has a core, the crowded one, slowed, past them
    from paratrain.simulate.system import Cluster
    host = Cluster("host", 1, 8, own, own, cores=2, contention=1.5, crowded=crowded)
    assert host.host_link(2) == own and host.host_link(4) == crowded.slowed(calibrate.oversubscribed(4, 2, 1.5))
    assert Cluster("old", 1, 8, own, own, cores=2, contention=1.5).host_link(4) == own.slowed(2 * 2 ** 0.5)


def test_a_two_rate_link_charges_the_bytes_past_its_cache_more():
    link = Link(alpha=0.0, beta=1e-9, gamma=0.0, cache_bytes=MB, beyond=0.5e-9)
    assert all_reduce("ring", 2, MB).seconds(link) == pytest.approx(MB * 1e-9)   # sends n; fits: one rate
    # 4 MB: 4 MB sent and 2 MB reduced, three quarters of it from beyond the cache
    assert all_reduce("ring", 2, 4 * MB).seconds(link) == pytest.approx(4 * MB * 1e-9 + 6 * MB * 0.75 * 0.5e-9)
    assert link.slowed(2).beyond == pytest.approx(1e-9) and link.slowed(2).cache_bytes == MB


def test_calibration_recovers_a_cache_size_and_the_rate_beyond_it():
    true = Link(alpha=20e-6, beta=0.2e-9, gamma=0.1e-9, cache_bytes=MB, beyond=0.3e-9)
    samples = [(a, P, n, all_reduce(a, P, n).seconds(true)) for a in ("ring", "tree") for P in (2, 4)
               for n in (64 << 10, 256 << 10, MB, 4 * MB, 16 * MB)]
    one_rate, _ = calibrate.fit(samples, caches=(0,))
    got, _ = calibrate.fit(samples)
    assert got.cache_bytes == MB and got.beyond == pytest.approx(true.beyond, rel=0.01)
    assert np.abs(calibrate.relative_errors(got, samples)).max() < 1e-6
    assert np.abs(calibrate.relative_errors(one_rate, samples)).max() > 0.1


def test_a_cliff_link_charges_every_byte_once_the_buffer_is_past_its_cache_and_calibration_finds_it():
    """Past a cliff link's cache every byte is charged ``beyond`` more, not only those
    past it (a ramp); the fit tells the two shapes apart and recovers the cliff, which a
    ramp misfits."""
    cliff = Link(alpha=20e-6, beta=0.2e-9, gamma=0.1e-9, cache_bytes=MB, beyond=0.3e-9, cliff=True)
    assert all_reduce("ring", 2, MB).seconds(cliff) == pytest.approx(all_reduce("ring", 2, MB).seconds(
        Link(20e-6, 0.2e-9, 0.1e-9)))
    # 4 MB: 4 MB sent and 2 MB reduced, all of it from beyond the cache
    assert all_reduce("ring", 2, 4 * MB).seconds(cliff) == pytest.approx(20e-6 * 2 + 4 * MB * 0.2e-9
                                                                         + 2 * MB * 0.1e-9 + 6 * MB * 0.3e-9)
    assert cliff.slowed(2).cliff
    samples = [(a, P, n, all_reduce(a, P, n).seconds(cliff)) for a in ("ring", "tree") for P in (2, 4)
               for n in (64 << 10, 256 << 10, MB, 2 * MB, 4 * MB, 16 * MB)]
    got, _ = calibrate.fit(samples)
    assert got.cliff and got.cache_bytes == MB and got.beyond == pytest.approx(cliff.beyond, rel=0.01)
    assert np.abs(calibrate.relative_errors(got, samples)).max() < 1e-6
    assert calibrate._fit_constants(samples, None, 1.0, MB, cliff=False)[1] > 1e-3   # a ramp cannot


def test_ranks_sharing_cores_go_at_the_pace_of_the_most_crowded_core():
    assert calibrate.oversubscribed(2, 2, 2.0) == 1.0 and calibrate.oversubscribed(4, None, 2.0) == 1.0
    assert calibrate.oversubscribed(3, 2, 1.0) == 2.0            # two ranks on one core: twice the time
    assert calibrate.oversubscribed(3, 2, 2.0) == pytest.approx(2 * 1.5)
    assert calibrate.oversubscribed(4, 2, 2.0) == pytest.approx(4.0)
    assert calibrate.time_shared(3, 2) == 1.5 and calibrate.time_shared(1, 2) == 1.0


def test_crowding_is_fitted_from_synthetic_points_and_charged_to_a_group_larger_than_the_cores():
    """A synchronization of more ranks than cores costs base + per_work x the work between
    two (crowding.py): the fit recovers both, never below 0, and predict charges tensor
    parallelism's 4 a layer + 1 only where the tensor group outnumbers the cores."""
    import dataclasses

    from paratrain.simulate import crowding
    from paratrain.simulate.files import Cluster, Workload
    from paratrain.simulate.strategies import predict
    got = crowding.fit([(w, 0.0015 + 0.2 * w) for w in (0.001, 0.003, 0.008)])
    assert got.base_s == pytest.approx(0.0015) and got.per_work == pytest.approx(0.2)
    assert crowding.fit([(0.001, 0.002), (0.003, 0.001)]).per_work == 0   # falling: a constant, not a slope
    assert crowding.fit([(0.001, 0.001), (0.003, 0.003)]).base_s == pytest.approx(0, abs=1e-12)
    w = Workload("w", 1_000_000, 4, 8, 0.2, layers=4, hidden=64, seq_len=16)
    plain = Cluster("two cores", 1, 8, Link(1e-5, 1e-10), Link(1e-5, 1e-10), host_algorithms=("ring",), cores=2)
    crowded = dataclasses.replace(plain, crowding=crowding.Crowding(0.0015, 0.2))
    syncs = 4 * 4 + 1
    extra = syncs * (0.0015 + 0.2 * 0.2 / 2 / syncs)   # the step's compute is 4 ranks' on 2 cores: half is a rank's
    assert predict("tensor", w, crowded, 4, tp=4).step_s - predict("tensor", w, plain, 4, tp=4).step_s == \
        pytest.approx(extra)
    assert predict("tensor", w, crowded, 4, tp=2).step_s == predict("tensor", w, plain, 4, tp=2).step_s   # pairs
    assert predict("dp", w, crowded, 2).step_s == predict("dp", w, plain, 2).step_s   # a core each
    assert predict("dp", w, crowded, 4).wait_s == pytest.approx(0.0015 + 0.2 * 0.1)


def test_crowding_is_measured_with_processes_meeting_at_a_barrier():
    """The measurement itself, short: a point for each work size, the fit of them."""
    from paratrain.simulate import crowding
    fitted, points = crowding.measure(1, works_s=(0.001, 0.002), seconds=0.1)
    assert [w for w, _ in points] == [0.001, 0.002] and all(np.isfinite(e) for _, e in points)
    assert fitted.base_s >= 0 and fitted.per_work >= 0
