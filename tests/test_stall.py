"""The stall inspector and the flight recorder, as a user meets them: a rank late to an
all_reduce is named by every other rank with its stack, and the job still ends well; a rank
that never arrives is named by `paratrain trace --flight` after the timeout."""
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import python_m
from test_train import ok

LATE = """\
import os, time, torch, paratrain as pt
g = pt.init()
t = torch.ones(4)
g.all_reduce(t)
if g.rank == 1:
    time.sleep(float(os.environ["LATE_S"]))   # the late rank's line
g.all_reduce(t)
assert t[0].item() == g.world_size ** 2
pt.destroy()
"""


def run(tmp_path, script, n, env, *launcher):
    path = tmp_path / "job.py"
    path.write_text(script)
    e = dict(os.environ, **env)
    return python_m(["paratrain", "run", "-n", str(n), *launcher, str(path)], e, timeout=120)


@pytest.mark.timeout(120)
def test_a_late_rank_is_named_with_its_stack_and_the_job_ends_well(tmp_path):
    res = run(tmp_path, LATE, 3, {"LATE_S": "6", "PARATRAIN_TIMEOUT": "60"}, "--stall-s", "2")
    ok(res)
    reports = re.findall(r"\[rank (\d)\].*stall: rank (\d) has waited ([\d.]+)s in all_reduce "
                         r"\(group world, call #(\d+)\)", res.stdout + res.stderr)
    assert sorted(r[1] for r in reports) == ["0", "2"], res.stdout + res.stderr
    for _, _, waited, seq in reports:
        assert 2.0 <= float(waited) <= 3.0   # logged within 3 s of the stall's start
    text = res.stdout + res.stderr
    assert text.count("waiting for ranks [1], which have not made this call yet") == 2
    assert text.count("the late rank's line") >= 2   # rank 1's stack, shown by each waiting rank


@pytest.mark.timeout(120)
def test_under_mpirun_a_late_rank_is_named_too(tmp_path):
    """The mpi backend has no rendezvous store: rank 0 serves one for the stall inspector."""
    from test_mpi_backend import MPIRUN, _mpirun_env
    path = tmp_path / "job.py"
    path.write_text(LATE)
    env = _mpirun_env(LATE_S="6", PARATRAIN_TIMEOUT="60", PARATRAIN_STALL_S="2", PARATRAIN_BACKEND="mpi",
                      PARATRAIN_THREADS="1", OMP_NUM_THREADS="1")
    res = subprocess.run([MPIRUN, "--allow-run-as-root", "--oversubscribe", "-n", "3", sys.executable, "-m",
                          "mpi4py", str(path)], env=env, capture_output=True, text=True, timeout=90)
    text = res.stdout + res.stderr
    assert res.returncode == 0, text[-4000:]
    reports = re.findall(r"stall: rank (\d) has waited ([\d.]+)s in all_reduce \(group world, call #\d+\)", text)
    assert sorted(r[0] for r in reports) == ["0", "2"], text[-4000:]
    assert all(2.0 <= float(waited) <= 3.0 for _, waited in reports), reports
    assert text.count("waiting for ranks [1], which have not made this call yet") == 2, text[-4000:]
    assert text.count("the late rank's line") >= 2, text[-4000:]


NEVER = """\
import time, torch, paratrain as pt
g = pt.init()
t = torch.ones(4)
for _ in range(3):
    g.all_reduce(t)
if g.rank == 1:
    time.sleep(60)       # rank 1 never makes the fourth all_reduce
g.all_reduce(t)
"""


@pytest.mark.timeout(120)
def test_a_rank_that_never_arrives_is_named_by_the_flight_recorder(tmp_path):
    flight = tmp_path / "flight"
    res = run(tmp_path, NEVER, 2, {"PARATRAIN_TIMEOUT": "3", "PARATRAIN_FLIGHT_DIR": str(flight)})
    assert res.returncode != 0
    assert f"flight recorder: {flight}" in res.stdout + res.stderr   # the error says where the dump went
    dump = json.loads((flight / "rank-0.json").read_text())
    assert dump["records"][-1]["op"] == "all_reduce" and dump["records"][-1]["state"] == "failed"
    report = python_m(["paratrain", "trace", "--flight", str(flight)], dict(os.environ))
    ok(report)
    assert "the ranks part at all_reduce #4 of group world" in report.stdout, report.stdout
    assert "ranks [1] never arrived" in report.stdout, report.stdout
    assert "rank 1 last completed: all_reduce #3 of group world" in report.stdout, report.stdout


def test_sigusr1_dumps_the_flight_recorder(tmp_path):
    script = tmp_path / "wait.py"
    flight = tmp_path / "flight"
    script.write_text("import time, torch, paratrain as pt\n"
                      "g = pt.init()\n"
                      "g.all_reduce(torch.ones(2))\n"
                      "print('ready', flush=True)\n"
                      "time.sleep(30)\n")
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0",
               PARATRAIN_FLIGHT_DIR=str(flight))
    import sys
    proc = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(__import__("signal").SIGUSR1)
        for _ in range(100):
            if (flight / "rank-0.json").exists():
                break
            __import__("time").sleep(0.05)
        dump = json.loads((flight / "rank-0.json").read_text())
        assert dump["reason"] == "SIGUSR1"
        assert [r["op"] for r in dump["records"]][-1] == "all_reduce"
        # the script's own frame (the signal may land just before its sleep begins, on a busy machine)
        assert 'wait.py", line' in dump["stacks"]["MainThread"]
    finally:
        proc.kill()
        proc.wait()
