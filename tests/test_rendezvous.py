"""Rendezvous failures give messages that say what to do."""
import os
import socket
import subprocess
import sys
import time

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
    assert "disagree on the world size" in outs[0], outs[0]
    # rank 1 waits for a third rank; rank 0, having refused, is gone: it says so, not a raw network error
    assert "RendezvousError" in outs[1] and "lost the rendezvous" in outs[1] and "WORLD_SIZE" in outs[1], outs[1]


@pytest.mark.timeout(60)
def test_master_port_held_by_a_program_that_never_answers():
    """TCPStore's client waits forever on a listener that accepts but never answers
    its handshake; paratrain stops at the timeout and says what holds the port."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        start = time.monotonic()
        out = _run_alone(1, 2, s.getsockname()[1])
        took = time.monotonic() - start
    finally:
        s.close()
    assert "did not answer within 3s" in out and "MASTER_PORT" in out, out
    assert took < 30, f"gave up after {took:.0f}s with a 3 s timeout"


@pytest.mark.timeout(60)
def test_ranks_asking_for_different_backends():
    """Rank 0 on shm, rank 1 on torch: each would wait for the other's set-up keys
    until the timeout; both say which rank asked for what instead."""
    port = free_port()
    procs = []
    for rank, backend in ((0, "shm"), (1, "torch")):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PARATRAIN_TIMEOUT="20", PARATRAIN_BACKEND=backend)
        procs.append(subprocess.Popen([sys.executable, str(WORKERS / "failures.py"), "mismatch_op"], cwd=ROOT,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    start = time.monotonic()
    outs = outputs(procs, 50)
    assert time.monotonic() - start < 18, "the ranks waited for the timeout instead of comparing backends"
    for out in outs:
        assert "disagree on the backend" in out and "rank 0: shm, rank 1: torch" in out, out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("step,backend", [("agree", "shm"), ("engine", "torch")])
def test_rank_exiting_after_the_rendezvous_is_named(step, backend):
    """Rank 1 reaches the rendezvous, then exits during pt.init()'s next step: the
    others say that rank 1 exited, instead of torch's raw store timeout."""
    procs = spawn(3, "exit_after_rendezvous.py", step, env={"PARATRAIN_TIMEOUT": "4", "PARATRAIN_BACKEND": backend})
    outs = outputs(procs, 50)
    for out in (outs[0], outs[2]):
        assert "init failed: RendezvousError" in out and "ranks [1] " in out and "exited" in out, out


def test_a_free_port_is_chosen_below_the_ephemeral_range_and_never_twice():
    """Outgoing connections take their ports from the kernel's ephemeral range, so a port
    chosen there could be taken between the launcher's choice and rank 0's bind; and a
    job's master and servers must not be handed the same one."""
    from paratrain.launch import local
    low = local._ephemeral_low()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50 and all(low - 16384 <= p < low for p in ports), ports
    assert all(local.bind_error(p) is None for p in ports[:5])
