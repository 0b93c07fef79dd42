"""Rendezvous failures give messages that say what to do."""
import os
import socket
import subprocess
import sys

import pytest

from conftest import ROOT, WORKERS, outputs, spawn
from paratrain.launch.local import free_port


def _run_alone(rank, world, port, timeout="3"):
    """The output of one rank started alone (the others never come)."""
    procs = spawn(1, "failures.py", "mismatch_op", env={"RANK": str(rank), "WORLD_SIZE": str(world),
                                                      "PARATRAIN_TIMEOUT": timeout}, port=port)
    return outputs(procs, 60)[0]


@pytest.mark.timeout(60)
def test_port_in_use():
    s = socket.socket()
    s.bind(("", 0))
    s.listen()
    try:
        out = _run_alone(0, 2, s.getsockname()[1])
    finally:
        s.close()
    assert "port is in use" in out, out


@pytest.mark.timeout(60)
def test_unreachable_master():
    out = _run_alone(1, 2, free_port())  # nobody listens there
    assert "could not reach the rendezvous" in out, out


@pytest.mark.timeout(60)
def test_missing_ranks_are_named():
    out = _run_alone(0, 3, free_port())
    assert "only 1 of 3 ranks arrived" in out and "missing ranks [1, 2]" in out, out


@pytest.mark.timeout(60)
def test_world_size_disagreement():
    port = free_port()
    procs = []
    for rank, world in ((0, 2), (1, 3)):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), PARATRAIN_TIMEOUT="4")
        procs.append(subprocess.Popen([sys.executable, str(WORKERS / "failures.py"), "mismatch_op"], cwd=ROOT,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = outputs(procs, 60)
    assert any("disagree on the world size" in o for o in outs), outs
