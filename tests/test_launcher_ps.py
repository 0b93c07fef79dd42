"""The launcher's parameter-server policies: a killed server restarted from its
checkpoint directory (and given up on after --server-restarts), workers left
behind under --worker-failure continue, and `paratrain server` + `paratrain run
--ps-addrs` for servers on another host.

The restart tests run the real paratrain.ps.server; the worker script itself
finds its sibling server among the launcher's children in /proc and kills it,
so the launcher can run in this process (fast) and the kill lands at a known
point of the worker's script.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from paratrain.launch import free_port, main
from paratrain.launch.local import port_in_use
from paratrain.launch.serve import main as server_main
from paratrain.launch.servers import Restarts, ServerProcess
from paratrain.launch.watch import Policy, supervise
from paratrain.launch.worker import Worker
from test_launcher import REPO, alive, script, wait_until

@pytest.fixture(autouse=True)
def fresh_interpreters(monkeypatch):
    """These tests find the launcher's servers by their parent, command line and
    environment in /proc, which a fork of the fork server does not show as its own."""
    monkeypatch.delenv("PARATRAIN_FORKSERVER", raising=False)


# Worker-side helpers: the launcher's server children, as /proc shows them.
SIBLINGS = """
    import json, os, signal, sys, time

    def servers():
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if int(ppid) == os.getppid() and b"paratrain.ps.server" in cmd and state not in "ZX":
                found.append(int(pid))
        return found

    def next_server(seen):
        t = time.monotonic()
        while time.monotonic() - t < 30:
            new = [p for p in servers() if p not in seen]
            if new:
                return new[0]
            time.sleep(0.05)
        sys.exit("no new server process within 30 s")

    def env_of(pid):
        with open(f"/proc/{pid}/environ", "rb") as f:
            pairs = (kv.decode().split("=", 1) for kv in f.read().split(b"\\0") if b"=" in kv)
            return {k: v for k, v in pairs if k.startswith("PARATRAIN_PS_")}
"""


@pytest.mark.timeout(60)
def test_killed_server_is_restarted_with_the_same_env(tmp_path, capfd):
    s = script(tmp_path, SIBLINGS + """
    first = next_server([])
    before = env_of(first)
    open(os.path.join(before["PARATRAIN_PS_CHECKPOINT_DIR"], "marker"), "w").close()
    os.kill(first, signal.SIGKILL)
    print(json.dumps([before, env_of(next_server([first]))]))
    """)
    assert main(["--servers", "1", "-n", "1", "--server-restarts", "2", s]) == 0
    cap = capfd.readouterr()
    assert "paratrain run: server 0 was killed by SIGKILL; restarting it from its last checkpoint " \
           "(restart 1 of 2)" in cap.err, cap.err
    line = next(x for x in cap.out.splitlines() if x.startswith("[rank 0] ["))
    before, after = json.loads(line[len("[rank 0] "):])
    assert before["PARATRAIN_PS_RESTART"] == "0" and after["PARATRAIN_PS_RESTART"] == "1"
    for key in ("PARATRAIN_PS_INDEX", "PARATRAIN_PS_BIND", "PARATRAIN_PS_CHECKPOINT_DIR"):
        assert before[key] == after[key], key
    # a temporary checkpoint directory goes once the job has succeeded, full or not
    assert not os.path.exists(before["PARATRAIN_PS_CHECKPOINT_DIR"])


@pytest.mark.timeout(60)
def test_server_restarts_run_out(tmp_path, capfd):
    s = script(tmp_path, SIBLINGS + """
    first = next_server([])
    ckpt = env_of(first)["PARATRAIN_PS_CHECKPOINT_DIR"]
    open(os.path.join(ckpt, "marker"), "w").close()
    print("checkpoints", ckpt)
    os.kill(first, signal.SIGKILL)
    os.kill(next_server([first]), signal.SIGKILL)
    time.sleep(60)  # the launcher must stop this
    """)
    t0 = time.monotonic()
    rc = main(["--servers", "1", "-n", "1", "--server-restarts", "1", s])
    elapsed = time.monotonic() - t0
    cap = capfd.readouterr()
    ckpt = cap.out.split("checkpoints ", 1)[1].split()[0]
    try:
        assert rc == 1 and elapsed < 45, (rc, elapsed)
        assert cap.err.count("restarting it") == 1 and "(restart 1 of 1)" in cap.err
        assert "server 0 (pid " in cap.err and "after 1 restart (--server-restarts 1)" in cap.err, cap.err
        # the job failed: a temporary checkpoint directory with something in it is kept, and named
        assert f"checkpoints are kept in {ckpt}" in cap.err and os.path.isdir(ckpt)
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)



@pytest.mark.timeout(90)
def test_training_survives_a_server_killed_mid_run(tmp_path, capfd, monkeypatch):
    """The whole path: the launcher restarts the server, which loads its checkpoint,
    and the worker's client resends what the dead one never answered."""
    monkeypatch.setenv("PARATRAIN_PS_CHECKPOINT_CLOCKS", "2")
    s = script(tmp_path, SIBLINGS + """
    import torch
    import paratrain as pt
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    ps = pt.ps.connect()
    ps.register(model, optimizer="sgd", lr=0.05, consistency="bsp")
    for step in range(8):
        if step == 5:
            os.kill(next_server([]), signal.SIGKILL)
        ps.pull(model)
        model(torch.ones(2, 4)).sum().backward()
        ps.push(model)
        ps.clock()
        model.zero_grad()
    print("finished 8 steps, reconnects:", ps.reconnects)
    ps.close()
    """)
    assert main(["--servers", "1", "-n", "1", "--timeout", "40", s]) == 0
    cap = capfd.readouterr()
    assert "server 0 was killed by SIGKILL; restarting it from its last checkpoint (restart 1 of 3)" in cap.err
    assert "[server 0] restart 1: restored" in cap.out, cap.out
    assert "[rank 0] finished 8 steps, reconnects: 1" in cap.out

def _fake_server(code):
    return ServerProcess(0, [sys.executable, "-c", code], dict(os.environ))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("listens, restarts", [(False, 1), (True, 3)])
def test_a_server_that_fails_before_listening_is_retried_once(capfd, listens, restarts):
    """A server that cannot bind exits 1 before saying `listening on`: retried
    once, not --server-restarts times (it would fail the same way each time)."""
    say = "print('listening on tcp://127.0.0.1:1', flush=True); import time; time.sleep(0.3); " if listens else ""
    server = _fake_server(say + "import sys; sys.exit('cannot listen on tcp://127.0.0.1:1: Address already in use')")
    worker = Worker(0, 0, [sys.executable, "-c", "import time; time.sleep(30)"], dict(os.environ))
    for p in (server, worker):
        p.start()
        p.start_output()
    t0 = time.monotonic()
    rc = supervise([worker], servers=[server], policy=Policy(restarts=Restarts(3)))
    err = capfd.readouterr().err
    assert rc == 1 and time.monotonic() - t0 < 20
    assert err.count("restarting it from its last checkpoint") == restarts, err
    assert "Address already in use" in err.split("last lines of server 0:")[1]
    assert ("after 3 restarts" in err) == listens and ("before listening, again" in err) == (not listens)
    assert not alive(worker.pid)


# rank 1 registers, then dies; with SSP(0) rank 0's second pull waits for rank 1's
# clock, until the launcher's farewell tells the server rank 1 has left.
SSP_ONE_DIES = """
    import os, signal, torch
    import paratrain as pt
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    ps = pt.ps.connect()
    ps.register(model, optimizer="sgd", lr=0.1, consistency="ssp", staleness=0)
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    for step in range(5):
        ps.pull(model)
        model(torch.ones(3, 4)).sum().backward()
        ps.push(model)
        ps.clock()
        model.zero_grad()
    print("finished 5 steps")
    ps.close()
"""


@pytest.mark.timeout(90)
def test_worker_failure_continue_goes_on_without_the_dead_rank(tmp_path, capfd):
    s = script(tmp_path, SSP_ONE_DIES)
    ckpt = tmp_path / "ckpt"
    rc = main(["--servers", "1", "-n", "2", "--timeout", "40", "--worker-failure", "continue",
               "--server-checkpoints", str(ckpt), s])
    cap = capfd.readouterr()
    assert rc == 0, cap.err
    assert "[rank 0] finished 5 steps" in cap.out
    assert "paratrain run: rank 1 was killed by SIGKILL; the job goes on without it (--worker-failure continue)" \
        in cap.err
    assert "1 of 2 workers finished; lost rank 1 (was killed by SIGKILL)" in cap.err
    assert "did not acknowledge" not in cap.err
    assert ckpt.is_dir()  # a directory the user named is never removed


@pytest.mark.timeout(30)
def test_default_policy_still_stops_the_job(tmp_path, capfd):
    s = script(tmp_path, """
        import os, signal, time
        if os.environ["RANK"] == "1":
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """)
    t0 = time.monotonic()
    assert main(["-n", "2", s]) == 1
    err = capfd.readouterr().err
    assert time.monotonic() - t0 < 20
    assert "rank 1 (local rank 1, pid" in err and "stopped the rest of the job" in err
    assert "goes on without it" not in err


@pytest.mark.timeout(30)
def test_continue_fails_when_no_worker_finishes(tmp_path, capfd):
    s = script(tmp_path, "import sys; print('giving up'); sys.exit(3)\n")
    assert main(["-n", "2", "--worker-failure", "continue", s]) == 3
    err = capfd.readouterr().err
    assert err.count("the job goes on without it") == 2
    assert "no worker finished: rank 0 (exited with code 3), rank 1 (exited with code 3)" in err
    assert "[rank 0] giving up" in err  # the report shows the first lost rank's last lines


def _consecutive_free_ports(n):
    for _ in range(50):
        p = free_port()
        if p + n <= 65536 and not any(port_in_use(q) for q in range(p, p + n)):
            return p
    pytest.skip(f"found no {n} free consecutive ports")


def _children(pid):
    kids = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(p))
        except OSError:
            pass
    return kids


class Lines:
    """Collects a pipe's lines in a thread (so the process never blocks on it)."""

    def __init__(self, pipe):
        self.lines = []
        self.thread = threading.Thread(target=lambda: self.lines.extend(iter(pipe.readline, "")), daemon=True)
        self.thread.start()

    def find(self, prefix):
        return next((line for line in self.lines if line.startswith(prefix)), None)


PS_STEPS = """
    import os, torch
    import paratrain as pt
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    ps = pt.ps.connect()
    ps.register(model, optimizer="sgd", lr=0.1, consistency="bsp")
    for step in range(3):
        ps.pull(model)
        model(torch.ones(2, 8) * (1 + int(os.environ["RANK"]))).sum().backward()
        ps.push(model)
        ps.clock()
        model.zero_grad()
    ps.pull(model)
    print("weights", round(float(model.weight.sum()), 5), os.environ["PARATRAIN_PS_ADDRS"])
    ps.close()
"""


@pytest.mark.timeout(90)
def test_paratrain_server_serves_workers_started_apart(tmp_path, capfd):
    port = _consecutive_free_ports(2)
    cmd = [sys.executable, "-m", "paratrain", "server", "--servers", "2", "--port", str(port),
           "--host", "127.0.0.1", "--advertise", "127.0.0.1", "--timeout", "40"]
    server = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = Lines(server.stdout), Lines(server.stderr)
    try:
        assert wait_until(lambda: out.find("PARATRAIN_PS_ADDRS="), 30, 0.05), err.lines
        addrs = out.find("PARATRAIN_PS_ADDRS=").strip().split("=", 1)[1]
        assert addrs == f"tcp://127.0.0.1:{port},tcp://127.0.0.1:{port + 1}"
        assert main(["--ps-addrs", addrs, "-n", "2", "--timeout", "40", script(tmp_path, PS_STEPS)]) == 0
        lines = [x for x in capfd.readouterr().out.splitlines() if "weights" in x]
        assert len(lines) == 2 and len({x.split("] ", 1)[1] for x in lines}) == 1  # BSP: the same weights
        assert addrs in lines[0]
        pids = _children(server.pid)
        assert len(pids) == 2
        server.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        assert server.wait(timeout=20) == 130
        assert time.monotonic() - t0 < 10
        assert wait_until(lambda: not any(alive(p) for p in pids), 5), "servers outlived `paratrain server`"
        err.thread.join(5)
        assert any("got SIGINT; stopped 2 servers" in x for x in err.lines), err.lines
    finally:
        server.kill()
        server.wait()


@pytest.mark.timeout(30)
def test_paratrain_server_port_in_use(capfd):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert server_main(["--servers", "2", "--port", str(port - 1), "--host", "127.0.0.1"]) == 2
    err = capfd.readouterr().err
    assert f"port {port} is already in use" in err or f"port {port - 1} is already in use" in err, err


@pytest.mark.timeout(30)
@pytest.mark.parametrize("opts, needle", [
    (["--servers", "1", "--ps-addrs", "tcp://127.0.0.1:1"], "give one of them"),
    (["--ps-addrs", "127.0.0.1:5"], "is not tcp://HOST:PORT"),
    (["--servers", "1", "--nnodes", "2"], "paratrain server"),
    (["--server-checkpoints", "ck"], "is for the servers --servers starts"),
    (["--worker-failure", "maybe"], "invalid choice"),
])
def test_bad_server_options(tmp_path, capfd, opts, needle):
    s = script(tmp_path, "print('should not run')\n")
    assert main([*opts, s]) == 2
    cap = capfd.readouterr()
    assert needle in cap.err and "should not run" not in cap.out


@pytest.mark.timeout(30)
def test_ps_addrs_reach_workers_of_every_node(tmp_path, capfd):
    s = script(tmp_path, "import os; print(os.environ['RANK'], os.environ['PARATRAIN_PS_ADDRS'])\n")
    addrs = "tcp://ps-host.example:29600,tcp://ps-host.example:29601"  # never contacted: only printed
    assert main(["--ps-addrs", addrs, "--nnodes", "2", "--node-rank", "1", "-n", "1", s]) == 0
    assert capfd.readouterr().out.splitlines() == [f"[rank 1] 1 {addrs}"]
