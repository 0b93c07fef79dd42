"""`paratrain train --tensorboard`: the event files hold the run's numbers, read back with
TensorBoard's own reader and compared with metrics.jsonl."""
import json

import pytest

from test_train import front_end, ok, run_dirs, train


@pytest.mark.timeout(180)
def test_tensorboard_holds_the_runs_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ok(train(tmp_path, "--steps", "12", "--eval-every", "6", "--tensorboard"))
    (run,) = run_dirs(tmp_path)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    def scalars(folder):
        acc = EventAccumulator(str(run / "tb" / folder))
        acc.Reload()
        return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}

    job = scalars("job")
    assert [s for s, _ in job["loss"]] == [r["step"] for r in rows]
    assert [v for _, v in job["loss"]] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    assert [v for _, v in job["comm/wait_s"]] == pytest.approx([r["comm_wait_seconds"] for r in rows], rel=1e-5)
    evals = [(r["step"], r["accuracy"]) for r in rows if "accuracy" in r]
    assert [s for s, _ in job["eval/accuracy"]] == [s for s, _ in evals] == [6, 12]
    assert [v for _, v in job["eval/accuracy"]] == pytest.approx([v for _, v in evals], rel=1e-6)
    assert all(v > 0 for _, v in job["samples_per_s"])
    for rank in (0, 1):
        times = scalars(f"rank-{rank}")["step_time_s"]
        assert [s for s, _ in times] == list(range(1, 13)) and all(v > 0 for _, v in times)
    assert [v for _, v in scalars("rank-0")["step_time_s"]] == \
        pytest.approx([r["step_seconds"] for r in rows], abs=1e-4)


def test_without_tensorboard_the_flag_says_how_to_get_it(tmp_path, monkeypatch):
    from paratrain.train import tensorboard
    monkeypatch.setattr(tensorboard, "installed", lambda: False)
    res = front_end(tmp_path, "--tensorboard")
    assert res.returncode == 2 and "pip install -e '.[tensorboard]'" in res.stderr
