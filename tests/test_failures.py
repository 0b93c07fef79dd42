"""Misbehaving peers turn into clear errors, never hangs or silent corruption."""
import re
import time

import pytest

from conftest import launch, outputs, spawn


MISMATCHES = [
    ("mismatch_shape", ["float32 x 1000", "float32 x 2000"]),
    ("mismatch_dtype", ["float32 x 1000", "float64 x 1000"]),
    ("mismatch_op", ["op=sum", "op=max"]),
    ("mismatch_coll", ["all_reduce(", "all_gather("]),
]


def _every_rank_caught(res, n, words):
    """Each of the n ranks printed its MismatchError, and the errors name both sides
    and the rank that disagrees (tests/workers/failures.py: rank 1 is the odd one)."""
    caught = {l.split("]")[0] + "]" for l in res.stdout.splitlines() if "caught MismatchError" in l}
    assert caught == {f"[rank {r}]" for r in range(n)}, res.stdout + res.stderr
    for w in words + ["ranks [1] disagree with rank 0"]:
        assert w in res.stdout, res.stdout
    assert res.returncode != 0


@pytest.mark.timeout(90)
@pytest.mark.parametrize("scenario,words", MISMATCHES)
def test_shm_mismatch_is_an_error_on_every_rank(scenario, words, no_leftover_segments):
    _every_rank_caught(launch(3, "failures.py", scenario), 3, words)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("scenario,words", MISMATCHES)
def test_torch_mismatch_detected_in_debug_mode(scenario, words):
    """On Gloo the check is PARATRAIN_DEBUG's (an exchange of descriptors before each call)."""
    res = launch(2, "failures.py", scenario, env={"PARATRAIN_BACKEND": "torch", "PARATRAIN_DEBUG": "1"})
    _every_rank_caught(res, 2, words)


@pytest.mark.timeout(90)
def test_hierarchical_mismatch_detected_in_debug_mode_on_every_rank():
    """2 pretend hosts of 2 ranks, rank 1 all-reduces a longer tensor: with
    PARATRAIN_DEBUG=1 every rank, on both hosts, names the user's all_reduce and the
    rank that disagrees (without it, only rank 1's host sees it, in the inner reduce)."""
    res = launch(4, "failures.py", "mismatch_shape",
                 env={"PARATRAIN_PRETEND_HOSTS": "2", "PARATRAIN_DEBUG": "1"})
    caught = {l.split(":")[0] for l in res.stdout.splitlines() if "caught MismatchError" in l and "all_reduce(" in l}
    assert {"[rank 0] rank 0", "[rank 1] rank 1", "[rank 2] rank 2", "[rank 3] rank 3"} <= caught, res.stdout
    assert "float32 x 2000" in res.stdout and "ranks [1] disagree" in res.stdout, res.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["shm", "torch"])
def test_dead_peer_raises_on_survivor_naming_the_rank(backend):
    """Without a launcher to stop it, the survivor must notice on its own. On the
    torch backend Gloo reports a reset connection; paratrain finds the dead rank."""
    procs = spawn(2, "failures.py", "die", env={"PARATRAIN_TIMEOUT": "120", "PARATRAIN_BACKEND": backend})
    # 45 s is far below the 120 s timeout: passing means death was noticed, not waited out
    out0 = outputs(procs, 45)[0]
    assert "caught PeerError" in out0, out0
    assert re.search(r"rank 1 \(pid \d+\) died", out0), out0
    assert "all_reduce(float32 x 1048576" in out0, out0   # and the operation it was in


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["shm", "torch"])
def test_peer_killed_inside_a_collective_raises_on_every_survivor(backend):
    """Rank 1 is SIGKILLed while the three ranks loop 4 MiB all-reduces, so it dies
    inside one (not before it, as in the test above). Each survivor raises on its
    own, long before the 120 s timeout, naming the dead rank and the operation.
    (Three ranks starting beside the suite's other tests on 2 cores took up to 45 s
    in all; a survivor that never noticed would leave its loop after 60 s without
    the error, and fail the checks below.)"""
    procs = spawn(3, "failures.py", "die_mid", env={"PARATRAIN_TIMEOUT": "120", "PARATRAIN_BACKEND": backend})
    outs = outputs(procs, 90)
    assert procs[1].returncode == -9, outs[1]
    for r in (0, 2):
        assert procs[r].returncode == 3, outs[r]   # the worker's exit code for a caught CommError
        assert "caught PeerError" in outs[r], outs[r]
        assert re.search(r"rank 1 \(pid \d+\) died", outs[r]), outs[r]
        assert "all_reduce(float32 x 1048576, op=max" in outs[r], outs[r]


@pytest.mark.timeout(90)
def test_peer_killed_inside_a_hierarchical_collective_raises_on_every_survivor():
    """The same on the hierarchical backend, 2 pretend hosts of 2 ranks: rank 1 (not a
    leader) dies; rank 0, its host's leader, sees it die over shm, and the error
    spreads host by host as each survivor raises and exits (rank 2 sees rank 0's
    Gloo connection close, rank 3 its leader rank 2 die). Nobody waits for the
    120 s timeout."""
    procs = spawn(4, "failures.py", "die_mid", env={"PARATRAIN_TIMEOUT": "120", "PARATRAIN_PRETEND_HOSTS": "2"})
    outs = outputs(procs, 60)
    assert procs[1].returncode == -9, outs[1]
    for r in (0, 2, 3):
        assert procs[r].returncode == 3 and "caught PeerError" in outs[r], outs[r]
        assert re.search(r"rank \d \(pid \d+\) died", outs[r]), outs[r]
        # the step that failed may be a reduce or broadcast inside a host: the user's call is named too
        assert "all_reduce(float32 x 1048576, op=max" in outs[r], outs[r]
    assert re.search(r"rank 1 \(pid \d+\) died", outs[0]), outs[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["shm", "torch"])
def test_a_rank_waiting_for_a_late_peer_sleeps(backend):
    """Four workers on two cores must not starve each other, so a wait blocks (on
    shm after a spin of at most 200 us) instead of spinning: rank 0 waits about 2 s in an
    all-reduce for rank 1 and uses a small part of that in CPU time. The bound is
    loose (a quarter of the wait); a spinning wait would use all of it."""
    res = launch(2, "failures.py", "late", env={"PARATRAIN_BACKEND": backend})
    assert res.returncode == 0, res.stdout + res.stderr
    m = re.search(r"rank 0: waited ([\d.]+) s wall, ([\d.]+) s cpu", res.stdout)
    assert m, res.stdout
    wall, cpu = float(m.group(1)), float(m.group(2))
    assert wall > 1.0, res.stdout   # it did wait for rank 1
    assert cpu < 0.25 * wall, res.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["shm", "torch"])
def test_silent_peer_times_out_naming_the_rank(backend):
    procs = spawn(2, "failures.py", "hang", env={"PARATRAIN_TIMEOUT": "3", "PARATRAIN_BACKEND": backend})
    out0 = procs[0].communicate(timeout=45)[0]
    procs[1].kill()
    procs[1].wait()
    assert "caught CommTimeout" in out0, out0
    assert "waiting for ranks [1]" in out0 and "all_reduce" in out0, out0


@pytest.mark.timeout(60)
def test_launcher_stops_job_when_worker_is_killed_mid_collective(no_leftover_segments):
    res = launch(3, "failures.py", "die_mid", env={"PARATRAIN_TIMEOUT": "120"}, timeout=50)
    assert res.returncode != 0
    assert "rank 1" in res.stderr and "SIGKILL" in res.stderr, res.stderr


@pytest.mark.timeout(60)
def test_ctrl_c_stops_everything_and_leaves_no_segment(no_leftover_segments):
    import os
    import signal
    import subprocess
    import sys

    from conftest import ROOT, WORKERS
    proc = subprocess.Popen([sys.executable, "-m", "paratrain.run", "-n", "3", str(WORKERS / "failures.py"), "loop"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = 0
    for line in proc.stdout:
        seen += "looping" in line
        if seen == 3:
            break
    time.sleep(0.5)  # mid-collective
    proc.send_signal(signal.SIGINT)
    rest = proc.communicate(timeout=30)[0]
    assert proc.returncode == 130, rest
    time.sleep(0.5)
    script = str(WORKERS / "failures.py")
    orphans = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if script in args and "loop" in args:
            orphans.append(pid)
    assert not orphans, f"orphan workers {orphans}"
