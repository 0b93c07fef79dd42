"""`paratrain train --min-workers`: the main job, elastic. Workers are killed at chosen
steps (in a step, in a commit, in a re-form), two at once, one hangs; replacements join;
the world falls below --min-workers and comes back. Each run must end with the parameters
of a run that lost nothing: with the global batch kept, a step's gradient is the mean
over the same samples at any world size, so that run is one worker taking the whole
global batch (a step done again from a commit, or a sample used twice or skipped,
would show in the parameters). Every step is logged once, in order, whoever wrote it."""
import json

import pytest
import torch
from test_train import front_end, ok, run_dirs, side_by_side, train

WORKERS, BATCH, STEPS, COMMIT_EVERY = 4, 16, 60, 5
COMMON = ("--steps", STEPS, "--eval-every", STEPS, "--commit-every", COMMIT_EVERY)


# ZeRO: three deaths in each run, at 4, 3 and 2 workers; among them and the runs above
# every rank is lost at each size (worker ids: a worker's rank is its place among those left)
ZERO_KILLS = {"zero1": ("1:8", "3:20", "2:35"),    # ranks 1 at 4, 2 at 3, 1 at 2
              "zero2": ("0:8", "1:20", "2:35"),    # rank 0 each time: the writer moves
              "zero3": ("3:8", "1:20", "0:35")}    # ranks 3 at 4, 1 at 3, 0 at 2


# Meshes: a worker lost takes its replica out of the world. Tensor parallel (2 replicas of 2):
# worker 1 dies, its replica's worker 0 waits, a replacement takes worker 1's place and the
# replica comes back. A pipeline of 2 stages (2 replicas): worker 3 dies, worker 2 waits to the
# end. Both must end where one process taking each step's 16 samples ends.
MESH_STEPS = 40
MESHES = {"gpt_reference": ("--model", "gpt", "--workers", 1, "--min-workers", 1, "--batch-size", 2 * 8),
          "mesh_tp": ("--model", "gpt", "--tp", 2, "--dp", 2, "--min-workers", 2, "--max-restarts", 1,
                      "--batch-size", 8, "--fail", "1:12"),
          "mesh_pp": ("--model", "gpt", "--pp", 2, "--dp", 2, "--min-workers", 2, "--batch-size", 8,
                      "--fail", "3:8")}
MESHES = {name: (*job, "--steps", MESH_STEPS, "--eval-every", MESH_STEPS) for name, job in MESHES.items()}


# Compression with error feedback: 3 workers, worker 1 lost at step 12, back to the commit at
# step 10 on 2 workers, each starting from the mean of the 3 residuals. The same as a run of 3
# workers to step 10 resumed from its checkpoint on 2 (compression/checkpoint.py's rule).
ONEBIT_FLAGS = ("--compression", "onebit", "--optimizer", "adam")
ONEBIT = {"onebit_lost": ("--workers", 3, "--min-workers", 1, "--batch-size", BATCH, "--fail", "1:12", "--steps", 30,
                          *ONEBIT_FLAGS),
          "onebit_first": ("--workers", 3, "--min-workers", 1, "--batch-size", BATCH, "--steps", 10, *ONEBIT_FLAGS)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The elastic runs and the references, launched two at a time, once for the whole suite."""
    names = ("reference", "lost_and_joined", "below_min", "shrink", "zero_join", *ZERO_KILLS, *MESHES, *ONEBIT)
    paths = {name: tmp_path_factory.mktemp(name) for name in names}
    jobs = {
        "reference": ("--workers", 1, "--min-workers", 1, "--batch-size", BATCH * WORKERS),
        # rank 0 at 4 workers (rank 0's log and progress move to a survivor); a replacement
        # joins while worker 1 is slow (horovod #2652); worker 3 dies inside a commit
        "lost_and_joined": ("--workers", WORKERS, "--min-workers", 2, "--max-restarts", 1, "--batch-size", BATCH,
                            "--fail", "0:12", "--fail", "3:30:commit", "--straggler", "1:3", "--trace"),
        # two at once, below --min-workers until two replacements come (horovod #3494); one
        # dies in the middle of the next recovery (horovod #2995); one hangs (pytorch #123678).
        # --min-workers is the whole world: every loss waits below it for a replacement, so the
        # two are one loss to the job even when one dies well after the other (a loaded host)
        "below_min": ("--workers", WORKERS, "--min-workers", WORKERS, "--max-restarts", 4, "--batch-size", BATCH,
                      "--elastic-timeout", 60, "--fail", "1:8", "--fail", "2:8", "--fail", "0:10:reform",
                      "--fail", "3:40:hang"),
    }
    # --elastic-batch shrink: each worker keeps its batch, the learning rate follows the world
    jobs["shrink"] = ("--workers", 2, "--min-workers", 1, "--batch-size", BATCH, "--elastic-batch", "shrink",
                      "--lr", 0.04, "--fail", "0:10", "--tensorboard")   # rank 0 at 2 workers
    # below --min-workers before any commit: the replacement joins a world of the same size, and
    # its own first commit (taken there) must not pass for the dead worker's shard
    jobs["zero_join"] = ("--strategy", "zero", "--stage", 2, "--workers", WORKERS, "--min-workers", WORKERS,
                         "--max-restarts", 1, "--batch-size", BATCH, "--fail", "1:3")
    for name, kills in ZERO_KILLS.items():
        jobs[name] = ("--strategy", "zero", "--stage", name[-1], "--workers", WORKERS, "--min-workers", 1,
                      "--batch-size", BATCH, *[w for k in kills for w in ("--fail", k)])
    jobs.update(MESHES)
    jobs.update(ONEBIT)
    order = ["lost_and_joined", "reference", "below_min", "shrink", "zero_join", *ZERO_KILLS, *MESHES, *ONEBIT]

    results = side_by_side(*[(paths[name], *COMMON, *jobs[name]) for name in order])   # a job's --steps wins
    return {name: (res, run_dirs(paths[name])[0]) for name, res in zip(order, results)}


def parameters(run_dir):
    return torch.load(run_dir / "checkpoint.pt", weights_only=True)["model"]


def check_run(runs, name, hung=()):
    res, run_dir = runs[name]
    ok(res)
    ref_res, ref_dir = runs["reference"]
    ok(ref_res)
    expected, got = parameters(ref_dir), parameters(run_dir)
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v, rtol=1e-4, atol=1e-5, msg=f"{name}: {k} differs from the reference")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), "each step logged once, in order"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["elastic"]["global_batch"] == BATCH * WORKERS
    for e in summary["elastic_events"]:   # a join's times count from its start: a whole Python's start-up
        # a hang counts from its last heartbeat: it is declared dead PARATRAIN_ELASTIC_HEARTBEAT (4 s) later
        limit = 60 if e["kind"] != "lost" else 8 if set(e["workers"]) & set(hung) else 5
        assert e["detect_s"] is not None and 0 <= e["detect_s"] <= e["resume_s"] < 2 * limit, e
        assert e["detect_s"] < limit, e
        assert e["steps_redone"] == e["step"] - e["commit_step"] < COMMIT_EVERY + 1, e
    return res, summary


@pytest.mark.timeout(240)
def test_lost_ranks_and_a_joiner_end_with_the_parameters_of_a_run_that_lost_nothing(runs):
    res, summary = check_run(runs, "lost_and_joined")
    events = summary["elastic_events"]
    lost = [e for e in events if e["kind"] == "lost"]
    # the replacement may start in time to join the very reform that lets rank 0 go (a
    # slow host's loss takes longer to notice): then that world already holds it
    joined_with_it = sum(len(e["ranks"]) for e in events if e["kind"] == "joined" and e["step"] == 11
                         and e["world_size"] == lost[0]["world_size"] == WORKERS)   # (one reform: one world)
    resumed_on = WORKERS - 1 + joined_with_it
    assert lost[0]["ranks"] == [0] and lost[0]["world_size"] == resumed_on and lost[0]["step"] == 11, events
    assert any(e["kind"] == "joined" for e in events), events
    # died in the commit at step 30: the others had not agreed on it, and went back to the one before
    assert any(e["workers"] == [3] and e["step"] == 30 and e["commit_step"] == 30 - COMMIT_EVERY
               for e in lost), events
    assert f"rank 0 lost at step 11; resumed on {resumed_on} workers" in res.stdout
    assert summary["workers_at_start"] == WORKERS
    # traced: each worker's file is named by its id (ranks move); the killed one's was left empty
    trace = json.loads((runs["lost_and_joined"][1] / "trace.json").read_text())
    assert {1, 2, 4} <= {c["index"] for c in trace["otherData"]["clocks"]}, trace["otherData"]


@pytest.mark.timeout(240)
def test_below_min_workers_two_at_once_a_failed_recovery_and_a_hang(runs):
    res, summary = check_run(runs, "below_min", hung=[3])
    text = res.stdout + res.stderr
    assert f"below --min-workers {WORKERS}" in text, text[-3000:]
    assert "worker 3 sent no heartbeat" in text, text[-3000:]
    # (worker 0, set to die in the first re-form back to a commit at 10 or later, dies in that one)
    hang = next(e for e in summary["elastic_events"] if 3 in e["workers"])
    assert hang["detect_s"] > 3, hang   # from its silence, not from when it was declared dead
    events = summary["elastic_events"]
    assert any(e["kind"] == "lost" and e["ranks"] == [1, 2] for e in events), events
    assert sum(len(e["workers"]) for e in events if e["kind"] == "lost") == 4, events
    assert summary["workers"] == WORKERS


def test_shrink_keeps_each_workers_batch_and_scales_the_learning_rate(runs):
    res, run_dir = runs["shrink"]
    ok(res)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["elastic"]["batch"] == "shrink" and summary["elastic"]["global_batch"] == BATCH   # 1 worker left
    assert [e["world_size"] for e in summary["elastic_events"]] == [1]
    saved = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert saved["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.04 / 2)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # rank 0 was lost: its successor writes the job's TensorBoard scalars from the commit on
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    job = EventAccumulator(str(run_dir / "tb" / "job"))
    job.Reload()
    assert sorted({e.step for e in job.Scalars("loss")}) == list(range(1, STEPS + 1))
    assert all((run_dir / "tb" / f"rank-{w}").is_dir() for w in (0, 1))   # by worker id


@pytest.mark.timeout(240)
def test_an_elastic_run_resumes_from_its_checkpoint_where_its_data_order_was(runs, tmp_path):
    """30 steps, then --resume to 60 with a worker lost on the way: the reference's parameters.
    The checkpoint is an elastic run's: a run without --min-workers refuses it, saying why."""
    first = train(tmp_path / "first", "--workers", 2, "--min-workers", 1, "--batch-size", 2 * BATCH, "--steps", 30,
                  "--eval-every", 30, "--commit-every", COMMIT_EVERY)
    ok(first)
    checkpoint = run_dirs(tmp_path / "first")[0] / "checkpoint.pt"
    res = front_end(tmp_path, "--resume", checkpoint, "--steps", STEPS)
    assert res.returncode == 2 and "resume it with --min-workers" in res.stderr, res.stderr
    second = train(tmp_path / "second", "--workers", 2, "--min-workers", 1, "--batch-size", 2 * BATCH,
                   "--resume", checkpoint, "--fail", "1:40", *COMMON)
    ok(second)
    run_dir = run_dirs(tmp_path / "second")[0]
    for k, v in parameters(runs["reference"][1]).items():
        torch.testing.assert_close(parameters(run_dir)[k], v, rtol=1e-4, atol=1e-5, msg=k)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(31, STEPS + 1))


def test_elastic_options_are_checked_before_anything_starts(tmp_path):
    for args, message in [
        (("--min-workers", 3, "--workers", 2), "--min-workers (3) <= --workers (2)"),
        (("--min-workers", 1, "--strategy", "ps"), "--strategy ps is not elastic"),
        (("--min-workers", 1, "--model", "gpt", "--tp", 2, "--workers", 4), "a whole number of replicas of 2"),
        (("--max-restarts", 2), "give --min-workers too"),
        (("--elastic-batch", "shrink"), "are for an elastic job"),
        (("--fail", "1:3:commit"), "is for an elastic job"),
        (("--fail", "1:3:later", "--min-workers", 1), "WHEN is one of"),
    ]:
        res = front_end(tmp_path, *args)
        assert res.returncode == 2 and message in res.stderr, (args, res.stderr)


@pytest.mark.timeout(240)
def test_a_zero_replacement_before_the_first_commit_takes_the_dead_workers_shard_from_its_buddy(runs):
    res, summary = check_run(runs, "zero_join")
    kinds = [(e["kind"], e["commit_step"], e["world_size"]) for e in summary["elastic_events"]]
    assert kinds == [("lost", 0, WORKERS), ("joined", 0, WORKERS)], kinds


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", ZERO_KILLS)
def test_zero_shards_come_back_from_the_survivors_copies(runs, stage):
    """A dead rank's shard (parameters and optimizer state) comes from its buddy's copy,
    re-cut for the smaller world: the run still ends with the reference's parameters."""
    res, summary = check_run(runs, stage)
    lost = [e for e in summary["elastic_events"] if e["kind"] == "lost"]
    assert [e["world_size"] for e in lost] == [3, 2, 1], lost
    assert [e["workers"] for e in lost] == [[int(k.split(":")[0])] for k in ZERO_KILLS[stage]], lost


def gathered(run_dir):
    """The whole model a run saved: a pipeline saves each stage in a file of its own."""
    out = {}
    for path in sorted(run_dir.glob("checkpoint*.pt")):
        out.update(torch.load(path, weights_only=True)["model"])
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["mesh_tp", "mesh_pp"])
def test_a_mesh_drops_the_replica_of_a_lost_worker_and_ends_with_the_parameters_of_one_process(runs, name):
    res, run_dir = runs[name]
    ok(res)
    ok(runs["gpt_reference"][0])
    expected, got = gathered(runs["gpt_reference"][1]), gathered(run_dir)
    assert sorted(got) == sorted(expected)
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v, rtol=1e-3, atol=1e-4, msg=f"{name}: {k} differs from one process")
    summary = json.loads((run_dir / "summary.json").read_text())
    events = [(e["kind"], e["world_size"]) for e in summary["elastic_events"]]
    if name == "mesh_tp":   # worker 1's replica out; back with the replacement in worker 1's place (at
        # once, if it was ready before the others re-formed); the replica that holds the state first
        assert events in ([("lost", 2), ("joined", 4)], [("lost", 4), ("joined", 4)]), events
        assert "4 workers (ids [2, 3, 0, 4])" in res.stderr, res.stderr[-3000:]
    else:   # worker 3's replica out; worker 2 waits for a replacement that never comes
        assert events == [("lost", 2)], events
        assert "worker 2: the job finished before it could join" in res.stdout + res.stderr, res.stdout[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, MESH_STEPS + 1)), "each step logged once, in order"


@pytest.mark.timeout(240)
def test_error_feedback_residuals_survive_a_lost_worker_as_they_survive_a_resume_at_another_size(runs, tmp_path):
    ok(runs["onebit_lost"][0])
    ok(runs["onebit_first"][0])
    checkpoint = runs["onebit_first"][1] / "checkpoint.pt"
    second = train(tmp_path, "--workers", 2, "--min-workers", 1, "--batch-size", 3 * BATCH // 2, "--resume",
                   checkpoint, *COMMON, "--steps", 30, *ONEBIT_FLAGS)   # the same global batch on 2 workers
    ok(second)
    assert "each of the 2 starts from their mean" in second.stdout + second.stderr
    expected, got = parameters(run_dirs(tmp_path)[0]), parameters(runs["onebit_lost"][1])
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)
    events = json.loads((runs["onebit_lost"][1] / "summary.json").read_text())["elastic_events"]
    assert [(e["kind"], e["commit_step"], e["world_size"]) for e in events] == [("lost", 10, 2)], events
