"""The simulated clock of benchmarks/ssp_simulation.py, whose numbers ps/shard.py
cites: steps of one unit of work, slowed steps sleeping (f - 1) times their
measured compute time (train/slowdown.py), computing workers sharing the cores."""
import importlib.util
import pathlib

import pytest

PATH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "ssp_simulation.py"


@pytest.fixture(scope="module")
def sim():
    spec = importlib.util.spec_from_file_location("ssp_simulation", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pushes(cores, n):
    return [cores.next_push() for _ in range(n)]


def test_own_cores_push_after_their_factor(sim):
    cores = sim.Cores()
    cores.begin(0, 1.0)
    cores.begin(1, 3.0)
    assert _pushes(cores, 3) == [(1.0, 0), (3.0, 1), None]


def test_three_workers_on_two_cores_compute_at_two_thirds_speed(sim):
    cores = sim.Cores(2)
    for w, f in enumerate((3.0, 1.0, 1.0)):
        cores.begin(w, f)
    first = _pushes(cores, 2)                  # all three finish their work at 1.5
    assert first == [(pytest.approx(1.5), 1), (pytest.approx(1.5), 2)]
    cores.begin(1, 1.0)                        # worker 0 sleeps 2 x 1.5: two computing, a core each
    assert cores.next_push() == (pytest.approx(2.5), 1)
    assert cores.next_push() == (pytest.approx(4.5), 0)
    assert cores.next_push() is None


def test_a_sleeping_worker_leaves_the_core_to_the_others(sim):
    cores = sim.Cores(1)
    cores.begin(0, 2.0)
    cores.begin(1, 1.0)                        # two on one core: both done computing at 2
    assert cores.next_push() == (pytest.approx(2.0), 1)
    cores.begin(1, 1.0)                        # worker 0 sleeps until 4: worker 1 alone, done at 3
    assert cores.next_push() == (pytest.approx(3.0), 1)
    assert cores.next_push() == (pytest.approx(4.0), 0)


def test_step_factors_follow_the_slowdown(sim):
    jitter = sim.step_factors("jitter", 0, 100)
    assert len(jitter) == 3 and {f for row in jitter for f in row} == {1.0, 3.0}
    assert 0.2 < sum(f == 3.0 for row in jitter for f in row) / 900 < 0.4
    straggler = sim.step_factors("straggler", 0, 10)
    assert [set(row) for row in straggler] == [{1.0}, {3.0}, {1.0}]
