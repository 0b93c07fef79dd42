"""The strategy table of ``paratrain train`` (train/strategies/): one module a strategy.

What is checked: the table lists the strategies and each module has the whole
interface; --strategy offers what the table lists and each module's flags;
the trainer loop runs a strategy registered here, in this process, without
knowing its name (its step, its checkpoint, its summary fields); the options
one strategy owns are refused with the same messages and exit code 2 as
before, by that strategy's module; and the trainer and the front-end name no
strategy.
"""
import json
import re
import types
from pathlib import Path

import pytest
import torch

from paratrain.train import job, strategies, trainer
from paratrain.train.coordination import Lockstep
from paratrain.train.options import build_parser
from paratrain.train.strategies import STRATEGIES, allreduce, pipeline, ps, zero
from paratrain.train.strategies.base import ReplicaStep

ROOT = Path(__file__).resolve().parent.parent
INTERFACE = ("HELP", "SPARSE", "add_options", "check", "launcher_args", "SUMMARY", "make_step")


def test_the_table_lists_the_five_strategies_and_each_module_has_the_interface():
    assert list(STRATEGIES) == ["allreduce", "allreduce-naive", "ps", "pipeline", "zero"]
    assert STRATEGIES["allreduce"] is STRATEGIES["allreduce-naive"] is allreduce and STRATEGIES["ps"] is ps
    assert strategies.modules() == [allreduce, ps, pipeline, zero]
    for module in strategies.modules():
        missing = [name for name in INTERFACE if not hasattr(module, name)]
        assert not missing, (module.__name__, missing)
    assert strategies.DEFAULT in STRATEGIES


# ---- a strategy registered by the test ------------------------------------------------------------

class OneRankBoard:
    """coordination.py's board for a job of one worker: nobody to wait for."""

    def start(self):
        pass

    def beat(self, batches, seconds, force=False):
        pass

    def gather(self, report):
        return {0: report}, []


class PlainStep(ReplicaStep):
    """One worker, a local SGD: what a strategy's step object must offer, and no more
    (ReplicaStep's defaults: one whole model per worker, rank 0 evaluates and checkpoints)."""

    local_loss = False
    finish_changes_weights = True

    def __init__(self, task, args, settings):
        from paratrain.parallel.data import CommStats
        self.model = task.model
        self.stats = CommStats()
        self.rank, self.world_size = 0, 1
        self.opt = torch.optim.SGD(task.model.parameters(), lr=settings.lr)
        self.calls = {"before_step": 0, "after_backward": 0, "finish": 0, "loaded": None}
        self.level = args.fake_level

    def coordination(self, settings, start):
        return OneRankBoard(), Lockstep(settings.steps, start)

    def before_step(self):
        self.calls["before_step"] += 1
        self.opt.zero_grad()

    def after_backward(self):
        self.calls["after_backward"] += 1
        self.opt.step()
        self.stats.bytes += 1

    def logged_loss(self, loss):
        return loss.item()

    def finish(self):
        self.calls["finish"] += 1

    def state_dict(self):
        return {"fake": {"level": self.level}, "optimizer": self.opt.state_dict()}

    def load_state_dict(self, state):
        self.calls["loaded"] = state["fake"]
        self.opt.load_state_dict(state["optimizer"])


def fake_options(parser):
    g = parser.add_argument_group("--strategy fake")
    g.add_argument("--fake-level", type=int, default=0, help="how fake (--strategy fake)")


def fake_check(args, chosen):
    if not chosen and args.fake_level:
        return "--fake-level is for --strategy fake"
    if chosen and args.fake_level < 0:
        return "--fake-level must be >= 0"
    return None


@pytest.fixture
def fake(monkeypatch):
    """A strategy called fake in the table (taken out again after the test)."""
    made = []

    def make_step(task, args, settings):
        made.append(PlainStep(task, args, settings))
        return made[-1]

    module = types.ModuleType("fake")
    module.__dict__.update(
        HELP="fake: one worker, a local SGD (the test's)", SPARSE=False, add_options=fake_options,
        check=fake_check, launcher_args=lambda args: ["--fake-launcher-word"], make_step=make_step,
        SUMMARY={"backend": lambda step, args: "none", "fake_level": lambda step, args: step.level},
        made=made)
    monkeypatch.setitem(STRATEGIES, "fake", module)
    return module


def test_strategy_choices_and_flags_come_from_the_table(fake):
    parser = build_parser()
    assert parser.parse_args(["--strategy", "fake", "--fake-level", "2"]).fake_level == 2
    text = " ".join(parser.format_help().split())   # (argparse wraps the help at 80 columns)
    assert "{allreduce,allreduce-naive,ps,pipeline,zero,fake}" in text and "fake: one worker, a local SGD" in text
    for group in ("--strategy allreduce, allreduce-naive:", "--strategy ps:", "--strategy pipeline:",
                  "--strategy zero:", "--strategy fake:"):
        assert group in text
    for flag in ("--algorithm", "--bucket-mb", "--compression", "--servers", "--consistency", "--staleness",
                 "--predict-weights", "--stages", "--microbatches", "--schedule", "--virtual", "--stage"):
        assert flag in text


def test_a_name_the_table_does_not_list_is_refused():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--strategy", "fake"])


def test_the_trainer_loop_runs_a_strategy_it_does_not_know(fake, tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    common = ["--strategy", "fake", "--fake-level", "3", "--batch-size", "16", "--eval-every", "100", "--lr", "0.05"]
    summary = trainer.run(build_parser().parse_args([*common, "--steps", "4", "--run-dir", str(first)]))
    (step,) = fake.made
    assert step.calls == {"before_step": 4, "after_backward": 4, "finish": 1, "loaded": None}
    assert summary["strategy"] == "fake" and summary["steps"] == 4 and summary["batches_total"] == 4
    # its own summary fields, and every other strategy's keys present as None
    assert summary["backend"] == "none" and summary["fake_level"] == 3
    assert summary["algorithm"] is None and summary["staleness_histogram"] is None
    assert summary["bytes_communicated"] == 4
    assert "accuracy" in summary   # finish_changes_weights: evaluated after finish()
    assert json.loads((first / "summary.json").read_text())["fake_level"] == 3
    state = torch.load(first / "checkpoint.pt", weights_only=True)
    assert state["step"] == 4 and state["fake"] == {"level": 3} and "model" in state
    # resuming hands the strategy its own part of the checkpoint back
    trainer.run(build_parser().parse_args([*common, "--steps", "6", "--resume", str(first / "checkpoint.pt"),
                                           "--run-dir", str(second)]))
    resumed = fake.made[1]
    assert resumed.calls["loaded"] == {"level": 3} and resumed.calls["after_backward"] == 2


def test_the_front_end_asks_the_chosen_strategy_and_refuses_another_ones_flags(fake, tmp_path, capsys):
    runs = ["--runs", str(tmp_path / "runs")]
    assert job.main([*runs, "--strategy", "fake", "--fake-level", "-1"]) == 2
    assert "paratrain train: error: --fake-level must be >= 0" in capsys.readouterr().err
    assert job.main([*runs, "--fake-level", "2"]) == 2   # given to allreduce, the default
    assert "paratrain train: error: --fake-level is for --strategy fake" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()   # nothing was started


@pytest.mark.parametrize("args,message", [
    (["--strategy", "ps", "--resume", "x.pt"],
     "--resume with --strategy ps is not available yet (the optimizer state lives on the servers)"),
    (["--strategy", "ps", "--consistency", "ssp"],
     "--consistency ssp needs --staleness N (N >= 0; 0 behaves like bsp, inf like asp)"),
    (["--strategy", "ps", "--consistency", "ssp", "--staleness", "-1"], "--consistency ssp needs --staleness N"),
    (["--consistency", "ssp"], "--consistency ssp needs --staleness N"),
    (["--consistency", "asp"], "--consistency and --staleness are for --strategy ps"),
    (["--strategy", "allreduce-naive", "--staleness", "2"], "--consistency and --staleness are for --strategy ps"),
    (["--predict-weights"],
     "--predict-weights is for --strategy ps with --consistency asp or ssp (staleness > 0)"),
    (["--strategy", "ps", "--predict-weights"], "--predict-weights is for --strategy ps"),
    (["--strategy", "ps", "--consistency", "ssp", "--staleness", "0", "--predict-weights"],
     "--predict-weights is for --strategy ps"),
    (["--algorithm", "bogus"], "unknown --algorithm 'bogus'; choose direct, ring, tree or naive"),
    (["--strategy", "allreduce", "--algorithm", "bogus", "--resume", "nowhere.pt"], "unknown --algorithm 'bogus'"),
])
def test_each_strategy_refuses_its_own_bad_options_with_exit_code_2(tmp_path, capsys, args, message):
    assert job.main(["--runs", str(tmp_path / "runs"), *args]) == 2
    assert f"paratrain train: error: {message}" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("args", [
    ["--strategy", "allreduce-naive", "--algorithm", "bogus"],    # passed on as it always was
    ["--strategy", "ps", "--consistency", "asp", "--predict-weights", "--servers", "2"],
    ["--strategy", "ps", "--consistency", "ssp", "--staleness", "inf"],
    ["--strategy", "ps", "--algorithm", "ring", "--bucket-mb", "4"],  # accepted (and unused) as before
])
def test_what_was_accepted_still_is(args):
    assert strategies.check(build_parser().parse_args(args)) is None


def test_the_launcher_hears_of_servers_and_of_the_failure_policy_from_the_strategy():
    parse = build_parser().parse_args
    assert allreduce.launcher_args(parse([])) == []
    assert ps.launcher_args(parse(["--strategy", "ps", "--servers", "2"])) == ["--servers", "2"]
    from paratrain.launch.local import build_parser as launcher_parser
    knows = "--worker-failure" in launcher_parser().format_help()
    assert ps.launcher_args(parse(["--strategy", "ps", "--consistency", "asp"])) == (
        ["--servers", "1"] + (["--worker-failure", "continue"] if knows else []))


def test_the_parameter_server_labels_its_backend_and_refuses_a_resume_in_the_worker():
    args = build_parser().parse_args(["--strategy", "ps", "--servers", "2", "--consistency", "ssp", "--staleness",
                                      "3", "--predict-weights"])
    assert ps.backend(args) == "zeromq, 2 servers, ssp s=3, weight prediction"
    step = ps.ParameterServerStep.__new__(ps.ParameterServerStep)   # (no servers needed for these two)
    assert step.state_dict() == {"optimizer": {}}
    with pytest.raises(ValueError, match="not available yet"):
        step.load_state_dict({"optimizer": {}})


def test_the_trainer_and_the_front_end_name_no_strategy():
    for name in ("trainer.py", "job.py", "options.py"):
        text = (ROOT / "paratrain" / "train" / name).read_text()
        assert not re.search(r'"ps"|allreduce|ps_strategy|--servers|--consistency|--algorithm', text), name
