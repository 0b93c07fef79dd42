"""pt.elastic under `paratrain run --min-workers`: a worker killed mid-run is dropped, the
others re-form a world and go on from their last commit, and the run ends with the
parameters of a one-process replay that goes through the same world sizes at the same
steps (nothing lost, nothing used twice)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, WORKERS, flight_env, launch
from paratrain.launch import netns_pair

BATCH, COMMIT_EVERY, EPOCHS, SAMPLES = 8, 4, 2, 240


def data():
    g = torch.Generator().manual_seed(5)
    X = torch.randn(SAMPLES, 6, generator=g)
    y = X @ torch.randn(6, 1, generator=g) + 0.1 * torch.randn(SAMPLES, 1, generator=g)
    return X, y


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def replay(sizes):
    """One process: each step's gradient is the mean over the ranks of each rank's batch
    loss, the batches dealt as the ranks' samplers deal them. ``sizes``: {step: world
    size}; the world changes only at a commit, where the samplers deal the rest anew."""
    from paratrain.elastic import ElasticSampler
    X, y = data()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ranks, epoch, step, batches = None, 0, 0, iter(())
    while True:
        w = sizes.get(step + 1)
        if w is None:
            break
        if ranks is None or len(ranks) != w:   # a new world: the rest of the epoch dealt over it
            state = ranks[0].state_dict() if ranks else None
            ranks = [ElasticSampler(range(SAMPLES), seed=0, batch_size=BATCH, rank=r, num_replicas=w)
                     for r in range(w)]
            for s in ranks:
                s.set_epoch(epoch)
                if state is not None:
                    s.load_state_dict(state)
            batches = zip(*[iter(s) for s in ranks])
        got = next(batches, None)
        if got is None:   # the epoch is over
            epoch += 1
            for s in ranks:
                s.set_epoch(epoch)
            batches = zip(*[iter(s) for s in ranks])
            continue
        opt.zero_grad()
        torch.stack([torch.nn.functional.mse_loss(model(X[b]), y[b]) for b in got]).mean().backward()
        opt.step()
        step += 1
    return model.state_dict(), step


def run_and_replay(tmp_path, fail, *launcher_args, n=3, slow_below=0):
    out = tmp_path / "params.pt"
    res = launch(n, "elastic_dp.py", launcher_args=launcher_args,
                 env={"FAIL": fail, "OUT": str(out), "SLOW_BELOW": str(slow_below)})
    text = res.stdout + res.stderr
    assert res.returncode == 0, text[-4000:]
    return res, check_replay(res.stdout, out)


def check_replay(stdout, out):
    """The world sizes rank 0 printed, once the saved parameters in ``out`` were found equal
    to the replay's."""
    line = next(x for x in stdout.splitlines() if "sizes {" in x)
    sizes = {int(k): v for k, v in json.loads(line.split("sizes ", 1)[1]).items()}
    assert sorted(sizes) == list(range(1, len(sizes) + 1)), sizes
    expected, steps = replay(sizes)
    assert steps == len(sizes)
    got = torch.load(out, weights_only=True)
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)
    return sizes


@pytest.mark.timeout(120)
def test_a_killed_rank_0_is_dropped_and_the_rest_reach_the_replays_parameters(tmp_path):
    # worker 0 dies as it begins step 7: the survivors (now ranks 0 and 1) go back to the commit at step 4
    res, sizes = run_and_replay(tmp_path, "0:7", "--min-workers", "2")
    text = res.stdout + res.stderr
    assert "rank 0 was killed by SIGKILL; the job goes on without it" in text, text[-4000:]
    assert "generation 1: 2 workers (ids [1, 2])" in text, text[-4000:]
    assert "events [('lost', 4, 3, 2)]" in res.stdout, text[-4000:]
    assert [sizes[s] for s in (1, 4, 5, len(sizes))] == [3, 3, 2, 2], sizes
    # epoch 0: 4 steps of 3 x 8, the other 144 samples in steps of 2 x 8; epoch 1: 240 / 16
    assert len(sizes) == 4 + 9 + 15


@pytest.mark.timeout(120)
def test_a_replacement_joins_at_a_commit_and_gets_the_state_from_a_peer(tmp_path):
    # the last rank this time; steps on 2 workers take 0.25 s more, so that the replacement
    # arrives before the end
    res, sizes = run_and_replay(tmp_path, "2:7", "--min-workers", "2", "--max-restarts", "1", slow_below=3)
    text = res.stdout + res.stderr
    assert "started worker 3 in place of rank 2" in text, text[-4000:]
    assert sizes[len(sizes)] == 3, sizes   # back to 3 workers
    assert "events [('lost', 4, 3, 2), ('changed'" in res.stdout, text[-4000:]   # on 2 while it started


@pytest.mark.timeout(60)
def test_below_min_workers_the_job_waits_then_ends_saying_why(tmp_path):
    res = launch(2, "elastic_dp.py", launcher_args=("--min-workers", "2", "--elastic-timeout", "2"),
                 env={"FAIL": "1:3", "OUT": str(tmp_path / "never.pt")})
    text = res.stdout + res.stderr
    assert res.returncode != 0, text[-4000:]
    assert "below --min-workers 2; waiting up to 2s" in text, text[-4000:]
    assert "ElasticAbort" in text and "below --min-workers 2, for 2s (--elastic-timeout)" in text, text[-4000:]
    assert not (tmp_path / "never.pt").exists()


@pytest.mark.timeout(90)
@pytest.mark.skipif(netns_pair.check() is not None, reason=str(netns_pair.check()))
def test_a_host_whose_link_is_cut_is_declared_dead_by_its_heartbeat_and_the_other_goes_on(tmp_path):
    """Two pretend hosts, each in its own network namespace with its own launcher (--nnodes 2)
    and one worker, joined by a link. As it begins step 7, worker 1 cuts its host's link: no
    socket closes, nothing arrives, and nobody reports a death. The first host's launcher
    declares worker 1 dead when its heartbeat stops; worker 0, waiting for it in Gloo, gives
    up on the world and goes on alone from the commit at step 4, long before the
    collective's 30 s timeout. (A wait in shared memory gives up the same way:
    test_train_elastic's meshes.)"""
    out = tmp_path / "params.pt"
    with netns_pair.HostPair() as hosts:
        env = dict(os.environ, PARATRAIN_TIMEOUT="30", PARATRAIN_ELASTIC_HEARTBEAT="2", PARATRAIN_BACKEND="torch",
                   FAIL="1:7:cut", CUT=" ".join(hosts.cut_command(1)), OUT=str(out), **flight_env())
        launchers = [subprocess.Popen(hosts.run(h, [
            sys.executable, "-m", "paratrain.run", "--nnodes", "2", "--node-rank", str(h), "--master-addr",
            hosts.address(0), "--master-port", "29400", "-n", "1", "--min-workers", "1",
            str(WORKERS / "elastic_dp.py")]), cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT) for h in (0, 1)]
        try:
            text = launchers[0].communicate(timeout=80)[0]
        finally:
            for p in launchers:   # the second's worker dies with it (its parent-death signal)
                p.kill()
                p.wait()
    assert launchers[0].returncode == 0, text[-4000:]
    assert "worker 1 sent no heartbeat for" in text and "declared dead" in text, text[-4000:]
    assert "events [('lost', 4, 2, 1)]" in text, text[-4000:]
    assert "worker 1 (rank 1) was declared dead by the launcher: no heartbeat" in text, text[-4000:]
    sizes = check_replay(text, out)
    assert [sizes[s] for s in (1, 4, 5, len(sizes))] == [2, 2, 1, 1], sizes


def test_a_world_of_replicas_is_whole_replicas_each_worker_in_its_place():
    """The launcher's rules for --replica-size 2 (4 workers: replicas {0, 1} and {2, 3})."""
    from paratrain.launch.elastic import Coordinator
    from paratrain.launch.local import free_port
    c = Coordinator("127.0.0.1", free_port(), range(4), 2, 4, 5.0, replica=2)
    c.stop()   # its rules, without its thread
    assert c._complete({0, 2, 3}) == {2, 3}   # worker 1 lost: its replica is out, worker 0 waits
    c.formed, c.members = {0: {}}, {2, 3}     # the world after: replica 1 alone
    c._started(4, replacing=1)                 # in worker 1's place
    assert c._complete({0, 2, 3, 4}) == {0, 2, 3, 4}
    assert c._order({0, 2, 3, 4}) == [2, 3, 0, 4]   # the replica that holds the state first
    assert not c._parts_lost({0, 2, 3, 4})
    c._started(5, replacing=3)                 # then worker 3 dies too, before that world formed
    assert c._parts_lost({0, 2, 4, 5})         # no replica of the last world is whole: its parts are gone
    assert "the state of their parts is gone" in c.store.get("elastic/abort").decode()


def test_elastic_options_are_checked_before_anything_starts(capsys):
    from paratrain.launch.local import main
    script = str(ROOT / "tests" / "workers" / "elastic_dp.py")
    assert main(["-n", "2", "--min-workers", "3", script]) == 2
    assert "need 1 <= --min-workers (3) <= -n (2)" in capsys.readouterr().err
    assert main(["-n", "2", "--max-restarts", "1", script]) == 2
    assert "give --min-workers too" in capsys.readouterr().err


def test_the_benchmarks_figures_come_from_the_workers_timestamps():
    """paratrain bench elastic's arithmetic on a made-up round: worker 1 killed at t=10.0,
    the survivors' errors reach pt.elastic at 10.2 and 10.3, the next step at 10.9, the
    replacement (worker 4) starts at 11.0 and the world is back to 4 at 13.0."""
    from paratrain.bench.elastic import measure
    rows = [{"kind": "step", "worker": 0, "t": 9.0 + 0.1 * i, "step": 16 + i, "world": 4} for i in range(10)]
    rows += [{"kind": "commit", "worker": 0, "t": 9.45, "seconds": 0.01},
             {"kind": "kill", "worker": 1, "t": 10.0, "step": 26},
             {"kind": "changed", "worker": 0, "event": "lost", "step": 20, "caught_at": 10.2},
             {"kind": "changed", "worker": 2, "event": "lost", "step": 20, "caught_at": 10.3},
             {"kind": "step", "worker": 0, "t": 10.9, "step": 21, "world": 3},
             {"kind": "start", "worker": 4, "t": 11.5, "t_process": 11.0},
             {"kind": "step", "worker": 0, "t": 13.0, "step": 31, "world": 4}]
    got = measure(rows, 4)
    assert got["victim"] == 1 and got["redone_steps"] == 25 - 20
    assert got["detect_s"] == pytest.approx(0.3) and got["resume_s"] == pytest.approx(0.9)
    assert got["join_s"] == pytest.approx(2.0) and got["commit_share"] == pytest.approx(0.01 / (10 * 0.1))


def test_torchruns_figures_come_from_its_workers_timestamps():
    """torchrun restarts every worker from its checkpoint: worker 2 killed at t=10.0 (step 26),
    the agent stops the survivors at 10.15 and 10.2, the checkpoint was at step 20, and
    the new attempt's first step (21) is done at 14.5."""
    from paratrain.bench.elastic import measure_torchrun
    rows = [{"kind": "step", "worker": 0, "attempt": 0, "t": 9.0 + 0.1 * i, "step": 16 + i} for i in range(10)]
    rows += [{"kind": "commit", "worker": 0, "attempt": 0, "t": 9.45, "seconds": 0.05},
             {"kind": "kill", "worker": 2, "attempt": 0, "t": 10.0, "step": 26},
             {"kind": "stopped", "worker": 0, "attempt": 0, "t": 10.15},
             {"kind": "stopped", "worker": 1, "attempt": 0, "t": 10.2},
             {"kind": "step", "worker": 1, "attempt": 1, "t": 14.6, "step": 21},
             {"kind": "step", "worker": 0, "attempt": 1, "t": 14.5, "step": 21}]
    got = measure_torchrun(rows)
    assert got["detect_s"] == pytest.approx(0.15) and got["resume_s"] == pytest.approx(4.5)
    assert got["redone_steps"] == 25 - 20 and got["commit_share"] == pytest.approx(0.05 / (10 * 0.1))


@pytest.mark.timeout(120)
def test_a_dead_ranks_compressor_residual_comes_back_from_its_buddy(tmp_path):
    """Error feedback: what the ranks still owe the model is the mean of their residuals.
    Worker 1 dies after the commit at step 4; each survivor must start again from the
    mean of the three workers' committed states, worker 1's included (its neighbour's copy)."""
    res = launch(3, "elastic_residuals.py", launcher_args=("--min-workers", "2"), env={"DIR": str(tmp_path)})
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    committed = [torch.load(tmp_path / f"c4-w{w}.pt", weights_only=True) for w in range(3)]
    residuals = [k for k in committed[0] if k.startswith("residual/")]
    assert residuals and all(float(committed[1][k].abs().sum()) > 0 for k in residuals)
    for w in (0, 2):
        after = torch.load(tmp_path / f"after-w{w}.pt", weights_only=True)
        assert sorted(after) == sorted(committed[0])
        for k, v in after.items():
            if k in residuals:
                torch.testing.assert_close(v, torch.stack([c[k] for c in committed]).mean(0), msg=k)
            else:   # the same on every rank (the generator's state, the step count): the new rank 0's
                assert torch.equal(v, committed[0][k]) if torch.is_tensor(v) else v == committed[0][k], k
