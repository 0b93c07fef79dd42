"""Slow workers and the shared batch pool, through ``paratrain train`` as a user runs it.

What is checked, each against a number the test knows independently of the
code under test: a straggler's sleep is (FACTOR - 1) times its own measured
compute; jitter slows exactly the steps that the documented seeded generator
picks; under ASP the fast worker takes more of the job's batches and the
shares add up to steps x workers exactly, while BSP gives each worker the same
number; the servers' staleness histogram counts every read; and a worker
killed under ASP leaves the others to finish the job. No absolute timing is
asserted: the machine is shared and has 2 cores.
"""
import json
import random

import pytest

from test_train import ok, run_dirs, train


def summary_of(tmp_path):
    (run,) = run_dirs(tmp_path)
    return json.loads((run / "summary.json").read_text())


def by_rank(summary):
    return {w["rank"]: w for w in summary["per_worker"]}


def digits_tensors():
    from paratrain.train.tasks import build_task
    return sum(1 for p in build_task("digits").model.parameters() if p.requires_grad)


@pytest.mark.timeout(150)
def test_asp_straggler_takes_a_smaller_share_and_the_shares_add_up(tmp_path):
    steps, workers, factor = 40, 2, 4
    ok(train(tmp_path, "--strategy", "ps", "--consistency", "asp", "--workers", str(workers), "--steps", str(steps),
             "--straggler", f"1:{factor}", "--eval-every", "1000", "--target-loss", "2.2"))
    s = summary_of(tmp_path)
    w = by_rank(s)
    assert sorted(w) == [0, 1] and s["lost_workers"] is None
    assert w[0]["batches"] + w[1]["batches"] == s["batches_total"] == steps * workers
    assert w[0]["batches"] > w[1]["batches"]
    assert w[0]["share"] + w[1]["share"] == pytest.approx(1.0)
    # the straggler sleeps (factor - 1) x its own measured compute, on every one of its steps
    assert w[1]["slowed_steps"] == w[1]["batches"]
    assert (factor - 1) * 0.8 < w[1]["slowdown_s"] / w[1]["compute_s"] < (factor - 1) * 1.5
    assert w[0]["slowdown_s"] == 0 and w[0]["slowed_steps"] == 0
    # throughput is the job's: every batch over the longest training loop
    assert s["time_wall_training_s"] == max(x["loop_s"] for x in w.values())
    assert s["samples_per_s"] == pytest.approx(steps * workers * s["batch_per_worker"] / s["time_wall_training_s"])
    # every pull reads every tensor once (1 server: none is split): the training pulls and one final pull each
    hist = {int(k): v for k, v in s["staleness_histogram"].items()}
    assert sum(hist.values()) == (steps * workers + workers) * digits_tensors()
    assert max(hist) >= 1  # a 4x straggler is behind: some reads see the fast worker ahead
    assert 0 < s["time_to_target_s"] <= s["time_wall_training_s"] and s["target_loss"] == 2.2


def expected_jitter(seed, rank, p, steps):
    """The documented generator (slowdown.py): random.Random seeded by the string
    'paratrain-jitter/SEED/RANK', one draw per step, slowed when it is below p."""
    rng = random.Random(f"paratrain-jitter/{seed}/{rank}")
    return sum(rng.random() < p for _ in range(steps))


@pytest.mark.timeout(150)
def test_bsp_jitter_slows_the_seeded_steps_and_gives_equal_shares(tmp_path):
    steps, workers, seed = 20, 2, 7
    ok(train(tmp_path, "--strategy", "ps", "--consistency", "bsp", "--workers", str(workers), "--steps", str(steps),
             "--jitter", "0.4:3", "--seed", str(seed), "--eval-every", "1000"))
    s = summary_of(tmp_path)
    w = by_rank(s)
    assert [w[r]["batches"] for r in (0, 1)] == [steps, steps]
    assert [w[r]["share"] for r in (0, 1)] == [0.5, 0.5]
    for r in (0, 1):
        assert w[r]["slowed_steps"] == expected_jitter(seed, r, 0.4, steps)
        assert (w[r]["slowdown_s"] > 0) == (w[r]["slowed_steps"] > 0)
        assert w[r]["slowdown_s"] < 2 * w[r]["compute_s"] * 1.5  # at most every step slept 2x its compute
    assert s["jitter"] == "0.4:3" and s["straggler"] is None
    hist = {int(k): v for k, v in s["staleness_histogram"].items()}
    assert sum(hist.values()) == (steps * workers + workers) * digits_tensors()


@pytest.mark.timeout(120)
def test_allreduce_straggler_holds_the_others_back(tmp_path):
    steps, factor = 30, 3
    ok(train(tmp_path, "--workers", "2", "--steps", str(steps), "--straggler", f"1:{factor}", "--eval-every", "1000"))
    s = summary_of(tmp_path)
    w = by_rank(s)
    assert [w[r]["batches"] for r in (0, 1)] == [steps, steps] and s["batches_total"] == 2 * steps
    assert (factor - 1) * 0.8 < w[1]["slowdown_s"] / w[1]["compute_s"] < (factor - 1) * 1.5
    assert w[0]["slowdown_s"] == 0
    # lockstep: the fast worker spends the straggler's sleep waiting on communication
    assert w[0]["comm_wait_s"] > 0.5 * w[1]["slowdown_s"]
    assert s["staleness_histogram"] is None


def launcher_has_worker_failure():
    from paratrain.launch.local import build_parser
    return "--worker-failure" in build_parser().format_help()


@pytest.mark.timeout(150)
@pytest.mark.skipif(not launcher_has_worker_failure(), reason="the launcher has no --worker-failure yet")
def test_a_worker_killed_under_asp_leaves_the_rest_to_finish_the_job(tmp_path):
    """--fail 2:10: rank 2 dies by SIGKILL as it begins its 10th step; the two others
    take the rest of the job's batches, and only rank 2's are missing."""
    steps, workers = 150, 3
    res = train(tmp_path, "--strategy", "ps", "--consistency", "asp", "--workers", str(workers), "--steps", str(steps),
                "--eval-every", "1000", "--fail", "2:10")
    ok(res)
    s = summary_of(tmp_path)
    (lost,) = s["lost_workers"]
    assert lost["rank"] == 2 and lost["batches_at_last_heartbeat"] <= 9, lost
    w = by_rank(s)
    assert sorted(w) == [0, 1]
    survivors = w[0]["batches"] + w[1]["batches"]
    assert survivors == s["batches_total"]
    # rank 2's 9 batches, and the ticket it held as it died, are all that is missing
    assert steps * workers - 10 <= survivors <= steps * workers - 9, survivors
    assert "workers lost" in res.stdout


@pytest.mark.timeout(180)
def test_recsys_on_the_parameter_server_moves_only_the_batch_rows(tmp_path):
    """The 1M x 64 table stays on the servers: per step a worker moves the dense MLP
    (twice: pull and push) plus a few hundred rows, far below the 256 MB table, and
    training lowers the evaluation loss below the untrained model's (ln 2 at chance)."""
    steps = 60
    ok(train(tmp_path, "--strategy", "ps", "--model", "recsys", "--servers", "2", "--workers", "2",
             "--steps", str(steps), "--eval-every", "1000"))
    s = summary_of(tmp_path)
    table_bytes = 1_000_000 * 64 * 4
    dense_bytes = (512 * 64 + 64 + 64 + 1) * 4
    per_step = s["bytes_communicated"] / steps
    rows_per_step = (per_step - 2 * dense_bytes) / (64 * 4 * 2 + 8 * 2)   # pulled and pushed, with their ids
    assert 50 < rows_per_step < 64 * 8        # some rows, never more than the batch's ids
    assert per_step * 100 < table_bytes
    assert s["eval_loss"] < 0.66 < 0.693
