"""`paratrain plan`: the layouts a worker count allows, each predicted by the cost model and
ranked, with the `paratrain train` command for each (in-process: nothing is launched)."""
import copy
import dataclasses
import json
import time

import pytest

from paratrain.simulate import memory, plan, plan_command, timing
from paratrain.simulate.collectives import Link
from paratrain.simulate.system import Cluster, Workload

CALIBRATION = {"links": {"shm_direct": {"alpha": 2e-5, "beta": 2e-10, "gamma": 4e-10}}}
CLUSTER = Cluster("test", 1, 8, Link(2e-5, 2e-10), Link(2e-5, 2e-10), host_algorithms=("direct",))


def memory_workload():
    return Workload("gpt-like", 800_000, 4, 16, 0.1, layers=4, hidden=128, seq_len=64)


def test_the_layouts_of_4_workers():
    got = {(l.strategy, l.dp, l.pp, l.tp, l.microbatches) for l in plan.layouts(4, layers=4)}
    assert {("dp", 4, 1, 1, None), ("zero3", 4, 1, 1, None), ("tensor", 2, 1, 2, None), ("tensor", 1, 1, 4, None),
            ("pipeline", 2, 2, 1, 4), ("pipeline", 1, 4, 1, 8), ("pipeline-zb", 2, 2, 1, 8),
            ("pipeline", 1, 2, 2, 4), ("pipeline-zb", 1, 2, 2, 8)} <= got   # 3D: 2 stages of tp 2
    cut = next(l for l in plan.layouts(4, layers=4) if l.pp == 2 and l.tp == 2 and l.strategy == "pipeline-zb")
    assert cut.flags[-2:] == ["--tp", "2"] and "zb-h1" in cut.flags
    assert not any(l.pp * l.tp > 4 for l in plan.layouts(4, layers=4))
    assert not any(l.pp == 4 for l in plan.layouts(4, layers=3))   # a stage needs a layer
    # a tensor group's two replicas also compressing their gradients, as train runs them; tp 4 has one replica
    squeezed = [l for l in plan.layouts(4, layers=4) if l.compression]
    assert [(l.tp, l.dp, l.compression, l.flags[-1]) for l in squeezed] == [(2, 2, "topk", "topk:0.01"),
                                                                            (2, 2, "powersgd", "powersgd:4")]
    from paratrain.compare.strategies import refused
    assert all(refused(["--model", "gpt", "--workers", "4", *l.flags]) is None for l in squeezed)
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
    assert memory.state_bytes("tensor", P, memory.ADAM, 4, tp=2, compression="topk") == (16 * P + 4 * P) / 2


def test_plan_ranks_what_runs_and_says_why_the_rest_does_not(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(plan, "memory_here", lambda *a: None)   # the formulas; the compare test measures here
    monkeypatch.setattr(timing, "PART_TIMINGS", 1)   # each part timed once: this checks what is predicted
    (tmp_path / "c.json").write_text(json.dumps(CALIBRATION))
    assert plan_command.main(["--model", "mlp", "--workers", "2", "--calibration", str(tmp_path / "c.json"),
                              "--json"]) == 0
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
    assert plan_command.main(["--model", "mlp", "--workers", "2", "--calibration", str(tmp_path / "c.json"),
                      "--memory-gb", str(cap), "--json"]) == 0
    kept = json.loads(capsys.readouterr().out)["layouts"]
    assert "dp" not in {r["strategy"] for r in kept} and "zero3" in {r["strategy"] for r in kept}


def test_of_two_layouts_predicted_as_fast_the_one_that_holds_less_comes_first():
    """Ranked by samples per second (a 2-sample batch at 12 ms beats a 1-sample batch at 7);
    a tie, to the last bits of a float, goes to the layout that holds less, whatever order
    they came in."""
    from paratrain.simulate.step import Step
    fast_big = ("dp", Step(2, 0.010, batch_per_device=2), 60 * memory.MB)
    tied_big = ("zero1", Step(2, 0.012 - 3e-17, batch_per_device=2), 55 * memory.MB)   # its sums' last bits
    tied_small = ("zero2", Step(2, 0.012, batch_per_device=2), 53 * memory.MB)
    slow = ("pipeline", Step(2, 0.007, batch_per_device=1), 40 * memory.MB)
    for given in ([slow, tied_big, tied_small, fast_big], [tied_small, fast_big, slow, tied_big]):
        assert [r[0] for r in plan.best_first(given)] == ["dp", "zero2", "zero1", "pipeline"]


class FakeMeasured:
    """here.Measured's timings, given: a pipeline's ranks' actions, the optimizer (a
    worker's, the servers'), ..."""

    def __init__(self, ranks=None):
        self.ranks, self.asked = ranks, []

    def actions(self, microbatch, stages, schedule, microbatches, tp=1):
        from paratrain.simulate.stage_actions import StageActions
        self.asked.append((microbatch, stages, schedule, microbatches, tp))
        return StageActions.of_ranks(self.ranks[schedule], microbatches)

    def step(self, batch):
        return 0.1

    def cut(self, batch, tp):
        return 0.1 * (0.4 + 0.6 / tp)

    def optimizer(self):
        return 0.004

    def zero3(self, batch, workers):
        from paratrain.simulate.timing import Timed
        return Timed.of(0.099, 0.001)   # a stage-3 engine's forward and backward: the plain 0.096 and more

    def server_update(self):
        return 0.003

    def ps_step(self, consistency):
        return 0.005

    def stage_send(self, nbytes):
        self.sent = getattr(self, "sent", []) + [nbytes]
        return 0.0003

    def encode(self, spec, replicas, tp=1):
        self.encoded = getattr(self, "encoded", []) + [(spec, replicas, tp)]
        return 0.007 / tp


def pipeline_ranks():
    """Two ranks' F, B, W a micro-batch under each schedule: the last stage dearer; under
    1F1B the first's backward whole and the second's W inside its B."""
    from paratrain.simulate.stage_actions import RankActions
    return {"zb-h1": [RankActions(0.004, 0.004, 0.003), RankActions(0.005, 0.005, 0.003)],
            "1f1b": [RankActions(0.004, 0.006, 0.0), RankActions(0.005, 0.009, 0.0)]}


def test_a_pipeline_is_predicted_with_each_rank_s_actions_as_the_engine_ran_them():
    """Each rank's F, B and W as timed here (stage_actions.py) are its costs in the
    schedule, W its own action only where the schedule splits the backward; F and B each
    send a micro-batch's activations or their gradients, as timed between two stages here
    (here.stage_send_seconds), on one host. The step's compute is the slowest rank's,
    with its share of the optimizer."""
    from paratrain.parallel.pipeline import schedules
    w = memory_workload()
    for name, schedule in (("pipeline-zb", "zb-h1"), ("pipeline", "1f1b")):
        layout = plan.compare_layout(name, 2)
        measured = FakeMeasured(pipeline_ranks())
        step, _ = plan.predicted(layout, w, dataclasses.replace(CLUSTER, intra=Link(0, 0)), memory.ADAM,
                                 measured=measured)
        m, s = layout.microbatches, 0.0003
        assert set(measured.asked) == {(16 // m, 2, schedule, m, 1)}   # timed at a micro-batch's samples
        assert measured.sent == [w.layer_activation_bytes("") / m]   # one layer's output of a micro-batch
        cost = [{"F": r.F + s, "B": r.B + s, **({"W": r.W} if schedule == "zb-h1" else {})}
                for r in pipeline_ranks()[schedule]]
        makespan, busy, _ = schedules.simulate(schedule, 2, m, cost=cost)
        assert step.step_s == pytest.approx(makespan), name
        assert step.exposed_s == pytest.approx(2 * m * s)
        assert step.compute_s == pytest.approx(max(busy) - 2 * m * s)
        slowest = max(r.F + r.B + r.W for r in pipeline_ranks()[schedule])
        assert plan.compute_seconds(layout, w, measured) == pytest.approx(m * slowest + 0.004 / 2)
        across, _ = plan.predicted(layout, w, dataclasses.replace(CLUSTER, nodes=2, devices_per_node=1,
                                                                  intra=Link(0, 0), inter=Link(0, 0)),
                                   memory.ADAM, measured=FakeMeasured(pipeline_ranks()))
        assert across.exposed_s == 0   # across hosts: the link's alpha and beta, here none


def test_compression_is_charged_the_compressor_s_time_measured_on_the_model():
    """top-k, PowerSGD, and a tensor group's replicas compressing: the encoding charged is
    the compressor's call timed here (on a worker's shard of the cut model with --tp), not
    compressed.py's four passes, and it is shared out like compute when workers outnumber
    the cores."""
    from paratrain.simulate import compressed
    w = memory_workload()
    for layout, spec, tp in ((plan.compare_layout("topk", 2), "topk:0.01", 1),
                             (plan.compare_layout("powersgd", 2), "powersgd:4", 1),
                             (next(l for l in plan.layouts(4, 4) if l.compression == "topk"), "topk:0.01", 2)):
        measured = FakeMeasured(None)
        step, _ = plan.predicted(layout, w, CLUSTER, memory.ADAM, measured=measured)
        assert measured.encoded == [(spec, layout.dp, tp)] and step.extra_s == pytest.approx(0.007 / tp)
        assert step.extra_s != pytest.approx(compressed.encode_seconds(CLUSTER, w.gradient_bytes / tp))
        crowded, _ = plan.predicted(layout, w, dataclasses.replace(CLUSTER, cores=1), memory.ADAM, measured=measured)
        assert crowded.extra_s == pytest.approx(0.007 / tp * layout.dp * tp)   # dp x tp workers on 1 core
    step, _ = plan.predicted(plan.compare_layout("topk", 2), w, CLUSTER, memory.ADAM)   # nothing measured
    assert step.extra_s == pytest.approx(compressed.encode_seconds(CLUSTER, w.gradient_bytes))


def test_a_parameter_server_worker_computes_without_the_optimizer_which_its_server_runs():
    """A ps worker's compute is the measured step less the optimizer's step (the servers run
    it); the servers' update, timed as they run it, comes back as the step's extra (one
    server on one host: all of it)."""
    w = memory_workload()
    for name in ("ps-bsp", "ps-asp"):
        step, _ = plan.predicted(plan.compare_layout(name, 2), w, CLUSTER, memory.ADAM, measured=FakeMeasured(None))
        assert step.compute_s == pytest.approx(0.1 - 0.004) and step.extra_s == pytest.approx(0.003), name
    step, _ = plan.predicted(plan.compare_layout("ps-bsp", 2), w, CLUSTER, memory.ADAM)   # nothing measured
    assert step.compute_s == pytest.approx(0.1) and step.extra_s == 0


def test_a_zero_worker_steps_the_optimizer_on_its_share_of_the_parameters_alone():
    w = memory_workload()
    for stage in (1, 2, 3):
        for workers in (2, 4):
            layout = plan.compare_layout(f"zero{stage}", workers)
            computed = 0.099 if stage == 3 else 0.1 - 0.004   # stage 3's forward and backward on its engine
            assert plan.compute_seconds(layout, w, FakeMeasured(None)) == pytest.approx(computed + 0.004 / workers)
    assert plan.compute_seconds(plan.compare_layout("zero2", 2), w) == pytest.approx(0.1)   # nothing measured


def test_a_worker_s_compute_is_what_a_run_reports_of_each_layout():
    """The model's counterpart of a run's compute_seconds (no optimizer), a worker's on
    average: the whole step's; a tensor worker's cut step's; a pipeline's ranks' mean, as
    the engine ran them."""
    w, measured = memory_workload(), FakeMeasured(pipeline_ranks())
    for name in ("dp", "ps-asp", "zero1", "topk"):
        assert plan.worker_compute_seconds(plan.compare_layout(name, 2), w, measured) == pytest.approx(0.1 - 0.004)
    assert plan.worker_compute_seconds(plan.compare_layout("zero3", 2), w, measured) == pytest.approx(0.099)
    assert plan.worker_compute_seconds(plan.compare_layout("tensor", 2), w, measured) == pytest.approx(0.07 - 0.002)
    assert plan.worker_compute_seconds(plan.compare_layout("pipeline", 2), w, measured) == pytest.approx(
        4 * (0.010 + 0.014) / 2)
    assert plan.worker_compute_seconds(plan.compare_layout("pipeline-zb", 2), w, measured) == pytest.approx(
        4 * (0.011 + 0.013) / 2)


@pytest.mark.timeout(90)
def test_a_parameter_server_worker_s_step_is_timed_beside_a_real_server_and_predicted_with_it():
    """here.ps_step_seconds runs the worker's side of a ps step (push, the server's update,
    pull, the zeroing) against a server it forks, and leaves no process behind; a ps layout
    on one host takes it whole (its update as the step's extra), BSP with the round's sums."""
    import multiprocessing

    from paratrain.simulate import here
    measured, workload = here.Measured("digits"), here.workload_of("digits")
    for name, consistency in (("ps-asp", "asp"), ("ps-ssp", "asp"), ("ps-bsp", "bsp")):
        timed = measured.ps_step(consistency)
        assert timed > 0 and not multiprocessing.active_children(), name   # its server is gone
        step, _ = plan.predicted(plan.compare_layout(name, 2), workload, CLUSTER, memory.ADAM, measured=measured)
        sums = workload.gradient_bytes * CLUSTER.intra.gamma if consistency == "bsp" else 0.0   # the other's push
        assert step.extra_s == pytest.approx(measured.server_update()), name
        assert step.extra_s + step.exposed_s == pytest.approx(max(timed, measured.server_update()) + sums), name


@pytest.mark.timeout(60)
def test_a_pipeline_s_send_is_timed_between_two_real_stages_and_predicted_with_it():
    """here.stage_send_seconds sends a micro-batch's activations and their gradients back
    between two processes it forks (a shared-memory group of two, the engine's transport),
    once per size, and leaves no process behind; a pipeline on one host pays it on each F
    and B, 2m a step."""
    import multiprocessing

    from paratrain.simulate import here
    measured, workload = here.Measured("digits"), here.workload_of("digits")
    layout = plan.compare_layout("pipeline", 2)
    sent = workload.layer_activation_bytes("") / layout.microbatches
    timed = measured.stage_send(sent)
    assert timed > 0 and not multiprocessing.active_children()
    assert measured.stage_send(sent) is timed   # once per size
    step, _ = plan.predicted(layout, workload, CLUSTER, memory.ADAM, measured=measured)
    assert step.exposed_s == pytest.approx(2 * layout.microbatches * timed)


@pytest.mark.timeout(120)
def test_a_run_s_own_compute_sets_the_speed_of_its_second_prediction(monkeypatch):
    """compare's second prediction: a run that computed 1.25x as long as the model's timing
    is predicted with every timing 1.25x as long (its compute part too), whatever the layout;
    its steps' spread is what the model charges at each synchronization, a pipeline's
    meetings too (none for ASP's)."""
    from paratrain.simulate import here, timing
    monkeypatch.setattr(timing, "PART_TIMINGS", 1)   # each part timed once: this checks what is predicted
    for model, name in (("digits", "dp"), ("digits", "ps-bsp"), ("digits", "zero1"), ("digits", "zero3"),
                        ("digits", "pipeline"), ("digits", "pipeline-zb"), ("gpt", "tensor")):
        workload, measured, layout = here.workload_of(model), here.Measured(model), plan.compare_layout(name, 2)
        timed, _ = plan.predicted(layout, workload, CLUSTER, memory.ADAM, measured=measured)
        run = 1.25 * plan.worker_compute_seconds(layout, workload, measured)
        step, speed = plan.predict_from_run(model, 2, name, CLUSTER, timing.Timed.of(run, 0.0))
        assert speed == pytest.approx(1.25) and step.compute_s == pytest.approx(1.25 * timed.compute_s), name
        assert step.wait_s == 0, name   # steady steps: nobody waits for the slowest
        unsteady, _ = plan.predict_from_run(model, 2, name, CLUSTER, timing.Timed.of(run, 0.1 * run))
        assert unsteady.compute_s == step.compute_s and unsteady.wait_s > 0, name
    steps = [plan.predict_from_run("digits", 2, "ps-asp", CLUSTER, timing.Timed.of(0.01, spread))[0]
             for spread in (0, 1e-3)]
    assert steps[0].wait_s == steps[1].wait_s == 0   # ASP: nobody waits for a round
    # a slower worker than rank 0 sets the pace where they go in lockstep; a pipeline's speed
    # is its workers' mean (the model weighs its stages itself); ASP's and SSP's, rank 0's
    for name in ("dp", "ps-bsp", "zero3", "tensor", "ps-asp", "ps-ssp", "pipeline", "pipeline-zb"):
        model = "gpt" if name == "tensor" else "digits"
        run = timing.Timed.of(0.02, 0.0)
        alone, slower = (plan.predict_from_run(model, 2, name, CLUSTER, run, slowest=k, mean=m)[0]
                         for k, m in ((1.0, 1.0), (1.1, 1.05)))
        lockstep = name in ("dp", "ps-bsp", "zero3", "tensor")
        assert plan.in_lockstep(plan.compare_layout(name, 2)) == lockstep, name
        k = 1.1 if lockstep else 1.05 if name.startswith("pipeline") else 1.0
        assert slower.compute_s == pytest.approx(alone.compute_s * k), name


def test_a_pipeline_of_tensor_groups_computes_its_stage_as_the_cut_model_does():
    """--pp 2 --tp 2: a worker runs its cut stage's micro-batches, timed on the stages cut
    across the tensor group, and its share of the optimizer; the train command runs it."""
    from paratrain.compare.strategies import refused
    layout = next(l for l in plan.layouts(4, layers=4) if (l.strategy, l.pp, l.tp, l.microbatches) == (
        "pipeline", 2, 2, 4))
    measured = FakeMeasured(pipeline_ranks())
    assert plan.compute_seconds(layout, memory_workload(), measured) == pytest.approx(4 * 0.014 + 0.004 / 4)
    assert refused(["--model", "gpt", "--workers", "4", *layout.flags]) is None
    step, held = plan.predicted(layout, memory_workload(), CLUSTER, memory.ADAM, measured=measured)
    assert set(measured.asked) == {(4, 2, "1f1b", 4, 2)}   # the cut stages, a micro-batch's samples
    assert "2 stages of tp 2" in step.how and held > memory.state_bytes("pipeline", 800_000, memory.ADAM, 4, 2, 2)


@pytest.mark.timeout(120)
def test_a_pipeline_s_ranks_are_timed_on_the_engine_fed_by_stand_ins():
    """stage_actions.py builds every rank's stage as train does and runs the engine over
    stand-in neighbours: the last stage, fed the activations the stages before it would
    send and the real targets, computes the same gradients as one process on the whole
    batch; each rank's actions are timed, W its own only where the schedule splits."""
    import torch

    from paratrain.simulate import stage_actions
    from paratrain.simulate.timing import task_of
    from paratrain.train.strategies.pipeline import _loss_of
    task = task_of("gpt")
    x, y, pipes = stage_actions.stand_in_pipelines(task, 2, 2, "zb-h1", 4)
    first, last = pipes
    alone = copy.deepcopy(last.stage)   # the last stage in one process, on the whole batch
    with torch.no_grad():
        arriving = first.stage(x)
    expected = _loss_of(task)(alone(*(arriving if isinstance(arriving, tuple) else (arriving,))), y)
    expected.backward()
    loss = last.step(None, y)
    assert float(loss) == pytest.approx(float(expected.detach()), rel=1e-5)
    reference = dict(alone.named_parameters())
    held = [(n, q) for n, q in last.stage.named_parameters() if q.grad is not None]
    assert len(held) == len(reference)
    for name, q in held:
        torch.testing.assert_close(q.grad, reference[name].grad, rtol=1e-4, atol=1e-6)
    for schedule, split, together in (("zb-h1", True, 2), ("1f1b", False, 1)):
        timed = stage_actions.seconds(task, 2, 2, schedule, 4, warmup=1, timed=2, together=together)
        assert len(timed.ranks) == 2 and all(r.F > 0 and r.B > 0 for r in timed.ranks), schedule
        assert all((r.W > 0) == split for r in timed.ranks), schedule
        assert float(timed) == pytest.approx(4 * max(r.total for r in timed.ranks))
        assert timed.scaled(2.0).mean_step_s == pytest.approx(2 * timed.mean_step_s)


def test_a_rank_that_fails_while_the_ranks_are_timed_is_reported_at_once(monkeypatch, capfd):
    """A forked rank that raises ends the timing with an error naming the exit codes,
    without waiting out the timeout for the rank left waiting for it at the barrier."""
    from paratrain.simulate import stage_actions

    def rank_steps(pipe, optimizer, x, y, steps, turn, done, out):
        if pipe == "bad":
            raise ValueError("a stage that cannot step")
        turn.acquire()
        done.wait()

    monkeypatch.setattr(stage_actions, "_rank_steps", rank_steps)
    monkeypatch.setattr(stage_actions, "RANK_TIMEOUT_S", 60)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="exit codes"):
        stage_actions._run_in_turns([("good", None, None, None), ("bad", None, None, None)], 3, 2)
    assert time.monotonic() - t0 < 30
    assert "a stage that cannot step" in capfd.readouterr().err


def test_plan_without_a_calibration_says_what_to_run(tmp_path, capsys):
    assert plan_command.main(["--model", "mlp", "--calibration", str(tmp_path / "none.json")]) == 2
    assert "paratrain simulate --calibrate" in capsys.readouterr().err


def test_a_workers_peak_heap_sees_a_brief_allocation_and_a_footprint_splits_what_layouts_share(monkeypatch):
    """train/memory.py sees a 64 MiB activation that lives only until the next module's
    forward (the heap's peak, not where it ends), and a buffer alive where the trainer
    samples; a footprint is the measured peak split into what every layout shares and the
    activations, less the one-process state."""
    import numpy as np
    import torch

    from paratrain.simulate import footprint
    from paratrain.train.memory import PeakMemory, heap_mb
    if heap_mb() is None:
        pytest.skip("no mallinfo2 here (not glibc 2.33+)")

    class Wide(torch.nn.Module):
        def forward(self, x):
            return x + torch.ones(64 << 18)   # 64 MiB of float32, freed by the sum below

    watch = PeakMemory()
    assert float(torch.nn.Sequential(Wide()).forward(torch.zeros(1)).sum()) == 64 << 18
    report = watch.report()
    # (what the process freed meanwhile, a few KiB, comes off the 64 MiB)
    assert 63 <= report["peak_memory_mb"] < 80 and heap_mb() - watch.heap_before < 8
    watch = PeakMemory()
    brief = np.ones(32 << 17)   # 32 MiB of float64 where the trainer samples
    watch.sample()
    del brief
    assert 31 <= watch.report()["peak_memory_mb"] < 48
    assert report["peak_rss_mb"] >= 0
    got = footprint.measure("mlp", 8)   # in this process: the parts are there and ordered
    assert got["task_mb"] > 0 and got["peak_mb"] >= got["train_peak_mb"] >= got["steady_mb"] > 0
    monkeypatch.setattr(footprint, "measured", lambda *a: {"task_mb": 5, "steady_mb": 20, "train_peak_mb": 50,
                                                           "peak_mb": 60})
    MB = 1 << 20
    foot = footprint.footprint("gpt", 16, state_bytes=12 * MB)
    assert foot == footprint.Footprint(shared=(20 - 12) * MB, activations=30 * MB, evaluation=40 * MB, batch=16)
    # a pipeline stage of half the layers, 2 of 4 micro-batches in flight: a quarter of them
    layout = plan.Layout("pipeline", [], 1, pp=2, microbatches=4)
    workload = memory_workload()
    _, held = plan.predicted(layout, workload, CLUSTER, memory.ADAM, 4, footprint=foot)
    state = memory.state_bytes("pipeline", workload.params, memory.ADAM, 2, 2)
    assert held == pytest.approx(foot.shared + state + 40 * MB)           # the evaluation is the larger
    _, held = plan.predicted(layout, workload, CLUSTER, memory.ADAM, 4,
                             footprint=dataclasses.replace(foot, evaluation=0))
    assert held == pytest.approx(foot.shared + state + 30 * MB / 4)
    # a tensor group evaluates through its cut: measured at 60% of the whole at 2 ways, 80% of it
    # divides (0.2 + 0.8 / 2 = 0.6), so at 4 ways 0.2 + 0.8 / 4 of it
    cut = dataclasses.replace(foot, cut_evaluation_share=0.6)
    assert cut.evaluation_at(1) == 40 * MB and cut.evaluation_at(2) == pytest.approx(24 * MB)
    assert cut.evaluation_at(4) == pytest.approx(16 * MB)
    layout = plan.Layout("tensor", [], 1, tp=4)
    _, held = plan.predicted(layout, workload, CLUSTER, memory.ADAM, 4, footprint=cut)
    state = memory.state_bytes("tensor", workload.params, memory.ADAM, 4, tp=4)
    assert held == pytest.approx(cut.shared + state + max(30 * MB / 4, 16 * MB))


@pytest.mark.timeout(90)
def test_a_zero3_worker_s_compute_is_timed_on_its_engine_less_what_its_collectives_blocked(monkeypatch):
    """here.zero3_compute_seconds runs a real stage-3 engine over a ComputeOnlyGroup: it
    prefetches gathers (asynchronous) as a run's does, and the time it was blocked in a
    collective is left out, as a run's compute leaves it out (a blocking gather made to
    sleep 50 ms: the timing stays below one)."""
    import time

    from paratrain.simulate import here, timing
    made, gather = [], here.ComputeOnlyGroup.all_gather

    def sleepy(self, out, tensor, async_op=False):
        made.append(async_op)
        if not async_op:
            time.sleep(0.05)
        return gather(self, out, tensor, async_op)
    monkeypatch.setattr(here.ComputeOnlyGroup, "all_gather", sleepy)
    timing.forget_timings()
    computed = here.Measured("digits").zero3(32, 2)
    assert made.count(True) > 0 and made.count(False) > 0, made   # prefetched, and blocked on
    assert 0 < computed < 0.05 and computed.jitter >= 0
    timing.forget_timings()
