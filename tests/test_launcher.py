"""paratrain run: worker environment, output, failure handling, signals, cleanup.

Most tests call launch.local.main() in this process (fast); the ones that
signal the launcher run it as `python -m paratrain.run` in a subprocess.
Worker scripts are a few lines written into tmp_path.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import ROOT, WORKERS, outputs
from paratrain.launch import binding, free_port, main
from paratrain.launch.watch import GRACE

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def script(tmp_path, body, name="worker.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def alive(pid):
    """Running, not a zombie (in a container nobody may reap orphans)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False


def wait_until(cond, timeout, step=0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return cond()


# A worker that records its pid (atomically) and then sleeps: the launcher must stop it.
SLEEPER = """
    import os, sys, time
    d = sys.argv[1]
    tmp = os.path.join(d, f"{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    os.rename(tmp, os.path.join(d, f"rank{os.environ['RANK']}.pid"))
    time.sleep(60)
"""


def kill_leftovers(piddir):
    """If a test fails, do not leave its sleeping workers behind."""
    for f in piddir.glob("rank*.pid"):
        try:
            os.kill(int(f.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def read_pids(piddir, n):
    files = [piddir / f"rank{r}.pid" for r in range(n)]
    if not all(f.exists() for f in files):
        return None
    return [int(f.read_text()) for f in files]


@pytest.mark.timeout(30)
def test_env_for_three_workers(tmp_path, capfd, monkeypatch):
    """What each worker is told, and nothing of an outer torchrun job's left behind."""
    for stale, value in (("GROUP_WORLD_SIZE", "7"), ("ROLE_RANK", "5"), ("TORCHELASTIC_RUN_ID", "outer")):
        monkeypatch.setenv(stale, value)
    s = script(tmp_path, """
        import os
        keys = "RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK GROUP_WORLD_SIZE OMP_NUM_THREADS MKL_NUM_THREADS PARATRAIN_THREADS PYTHONUNBUFFERED"
        print(" ".join(os.environ[k] for k in keys.split()), "ROLE_RANK" in os.environ, "TORCHELASTIC_RUN_ID" in os.environ)
        print(os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"], os.environ["PARATRAIN_JOB_ID"])
    """)
    assert main(["-n", "3", s]) == 0
    out = capfd.readouterr().out.splitlines()
    env_lines = {line for line in out if "127.0.0.1" not in line}
    assert env_lines == {f"[rank {r}] {r} {r} 3 3 0 1 1 1 1 1 False False" for r in range(3)}
    master = [line.split("] ", 1) for line in out if "127.0.0.1" in line]
    assert sorted(prefix for prefix, _ in master) == ["[rank 0", "[rank 1", "[rank 2"]
    assert len({rest for _, rest in master}) == 1  # one port, one job id for all
    addr, port, job = master[0][1].split()
    assert 0 < int(port) < 65536 and job


@pytest.mark.timeout(60)
def test_a_free_port_is_chosen_and_workers_compute_on_one_thread(tmp_path, capfd):
    """Without --master-port the launcher picks a port nobody holds: with torch's
    usual 29500 held here, rank 0's store still binds and the workers meet (an
    all_reduce of ones gives 2). torch computes on one thread in each worker,
    before pt.init() (OMP_NUM_THREADS) and after it (PARATRAIN_THREADS)."""
    s = script(tmp_path, """
        import os
        import torch
        before = torch.get_num_threads()
        import paratrain as pt
        g = pt.init()
        t = torch.ones(4)
        g.all_reduce(t)
        print(os.environ["MASTER_PORT"], before, torch.get_num_threads(), t.tolist())
        pt.destroy()
    """)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        try:
            held.bind(("", 29500))
            held.listen()
        except OSError:
            pass   # somebody holds it already: just as good
        assert main(["-n", "2", s]) == 0
    lines = [line.split("] ", 1)[1].split(" ", 3) for line in capfd.readouterr().out.splitlines()
             if line.startswith("[rank")]
    assert len(lines) == 2 and len({port for port, *_ in lines}) == 1, lines
    port, before, after, total = lines[0]
    assert int(port) != 29500 and (before, after) == ("1", "1") and total == "[2.0, 2.0, 2.0, 2.0]", lines


@pytest.mark.timeout(60)
def test_the_console_script_runs_workers(tmp_path):
    """`paratrain run` as a user types it: the console script pip installed beside
    this Python, not launch.main called in this process."""
    exe = os.path.join(os.path.dirname(sys.executable), "paratrain")
    assert os.access(exe, os.X_OK), f"no console script at {exe}: pip install -e . makes it"
    s = script(tmp_path, """
        import os
        print("hello from", os.environ["RANK"], "of", os.environ["WORLD_SIZE"])
    """)
    p = subprocess.run([exe, "run", "-n", "2", s], capture_output=True, text=True, timeout=50)
    assert p.returncode == 0, p.stdout + p.stderr
    assert sorted(l for l in p.stdout.splitlines() if "hello" in l) == \
        ["[rank 0] hello from 0 of 2", "[rank 1] hello from 1 of 2"], p.stdout
    bench = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "collectives.py"), "--help"],
                           capture_output=True, text=True, timeout=50)
    assert bench.returncode == 0 and "--collectives" in bench.stdout, bench.stdout + bench.stderr


@pytest.mark.timeout(30)
def test_threads_and_timeout_are_exported(tmp_path, capfd):
    s = script(tmp_path, """
        import os
        print(os.environ["OMP_NUM_THREADS"], os.environ["PARATRAIN_THREADS"], os.environ["PARATRAIN_TIMEOUT"])
    """)
    assert main(["-n", "1", "--threads", "3", "--timeout", "2.5", s]) == 0
    assert capfd.readouterr().out.splitlines() == ["[rank 0] 3 3 2.5"]


AFFINITY = """
    import os
    print(os.environ["LOCAL_RANK"], *sorted(os.sched_getaffinity(0)))
"""


def affinities(out):
    """{local rank: its CPUs} from the AFFINITY script's lines."""
    rows = [line.split("] ", 1)[1].split() for line in out.splitlines()]
    return {int(r[0]): {int(c) for c in r[1:]} for r in rows}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("n, threads", [(2, 1), (3, 1), (2, 2)])
def test_bind_to_core_pins_each_worker_to_its_own_block_of_cpus(tmp_path, capfd, n, threads):
    """Local rank i gets CPUs i*threads .. i*threads+threads-1 of the launcher's
    own, in order, wrapping around with a note when there are too few."""
    cpus = sorted(os.sched_getaffinity(0))
    assert main(["-n", str(n), "--threads", str(threads), "--bind-to", "core", script(tmp_path, AFFINITY)]) == 0
    cap = capfd.readouterr()
    want = {i: {cpus[(i * threads + k) % len(cpus)] for k in range(min(threads, len(cpus)))} for i in range(n)}
    assert affinities(cap.out) == want
    assert ("workers share CPUs" in cap.err) == (n * threads > len(cpus))


@pytest.mark.timeout(30)
def test_unbound_workers_keep_the_launchers_cpus(tmp_path, capfd):
    assert main(["-n", "2", script(tmp_path, AFFINITY)]) == 0
    assert affinities(capfd.readouterr().out) == {i: set(os.sched_getaffinity(0)) for i in range(2)}


@pytest.mark.timeout(30)
def test_multinode_arithmetic(tmp_path, capfd):
    s = script(tmp_path, """
        import os
        print(*(os.environ[k] for k in "RANK LOCAL_RANK WORLD_SIZE GROUP_RANK MASTER_PORT".split()))
    """)
    assert main(["--nnodes", "2", "--node-rank", "1", "-n", "2", s]) == 0
    out = set(capfd.readouterr().out.splitlines())
    assert out == {"[rank 2] 2 0 4 1 29500", "[rank 3] 3 1 4 1 29500"}


def start_two_nodes(s, env, nprocs):
    """`paratrain run --nnodes 2 --node-rank K -n nprocs[K] s` twice, as on two
    machines (here one), meeting at a free port; output of each in one pipe."""
    port = str(free_port())
    return [subprocess.Popen([sys.executable, "-m", "paratrain.run", "--nnodes", "2", "--node-rank", str(k),
                              "--master-addr", "127.0.0.1", "--master-port", port, "-n", n, s],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for k, n in enumerate(nprocs)]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", ["shm", "hierarchical"])
def test_two_launchers_as_two_nodes_meet_and_all_reduce(tmp_path, backend):
    """`paratrain run --nnodes 2 --node-rank K` twice, as on two machines (here one):
    the four ranks meet at the master and all-reduce; the hierarchical backend
    takes the two launchers for two hosts (PARATRAIN_PRETEND_HOSTS)."""
    s = script(tmp_path, """
        import torch
        import paratrain as pt
        g = pt.init()
        x = torch.full((1001,), float(g.rank + 1))
        g.all_reduce(x)
        assert torch.equal(x, torch.full((1001,), 10.0)), x[:4]
        print("sum", int(x[0]), "on", g.backend)
    """)
    traced = tmp_path / "trace"   # shm: both nodes trace into one folder, as a shared file system
    env = dict(os.environ, PARATRAIN_TIMEOUT="30", PARATRAIN_BACKEND=backend,
               **({"PARATRAIN_PRETEND_HOSTS": "2"} if backend == "hierarchical" else {"PARATRAIN_TRACE": str(traced)}))
    nodes = start_two_nodes(s, env, ("2", "2"))
    outs = outputs(nodes, 75)
    assert [p.returncode for p in nodes] == [0, 0], outs
    assert sorted(l for o in outs for l in o.splitlines() if "sum" in l) == \
        [f"[rank {r}] sum 10 on {backend}" for r in range(4)]
    if backend == "shm":   # node 0 merged every node's ranks; node 1 left it to node 0
        assert "node 0 merges every node's files" in outs[1] and "trace.json" in outs[0], outs
        from paratrain.trace import analysis
        ranks = {e["pid"] for e in analysis.load(str(traced)) if e.get("ph") == "X"}
        assert ranks == {0, 1, 2, 3}, ranks


@pytest.mark.timeout(60)
def test_two_nodes_given_different_n_are_told_so(tmp_path):
    """Node 0 with -n 1, node 1 with -n 2: the world sizes differ (2 and 4), so
    ranks go missing; both launchers fail and the ranks' errors name the cause."""
    s = script(tmp_path, "import paratrain as pt\npt.init()\nprint('should not get here')\n")
    nodes = start_two_nodes(s, dict(os.environ, PARATRAIN_TIMEOUT="4"), ("1", "2"))
    outs = outputs(nodes, 45)
    assert all(p.returncode != 0 for p in nodes), outs
    for out in outs:
        assert "the same -n on every node" in out and "should not get here" not in out, out[-3000:]


@pytest.mark.timeout(30)
def test_script_args_pass_through_unchanged(tmp_path, capfd):
    s = script(tmp_path, """
        import json, sys
        print(json.dumps(sys.argv[1:]))
    """)
    passed = ["--lr", "0.1", "-n", "5", "--", "--threads=9", "-m", "x y"]
    assert main(["-n", "1", s, *passed]) == 0
    line = capfd.readouterr().out.strip()
    assert line.startswith("[rank 0] ")
    assert json.loads(line[len("[rank 0] "):]) == passed


@pytest.mark.timeout(30)
def test_no_prefix_and_stderr(tmp_path, capfd):
    s = script(tmp_path, """
        import sys
        print("to out")
        print("to err", file=sys.stderr)
    """)
    assert main(["-n", "1", s]) == 0
    cap = capfd.readouterr()
    assert (cap.out, cap.err) == ("[rank 0] to out\n", "[rank 0] to err\n")
    assert main(["-n", "1", "--no-prefix", s]) == 0
    cap = capfd.readouterr()
    assert (cap.out, cap.err) == ("to out\n", "to err\n")


@pytest.mark.timeout(30)
def test_module_mode(tmp_path, capfd, monkeypatch):
    script(tmp_path, """
        import os, sys
        print("module", os.environ["RANK"], sys.argv[1:])
    """, name="tiny_mod.py")
    monkeypatch.chdir(tmp_path)  # `python -m` finds modules in the working directory
    assert main(["-n", "2", "-m", "tiny_mod", "-n", "7"]) == 0
    assert set(capfd.readouterr().out.splitlines()) == {
        "[rank 0] module 0 ['-n', '7']", "[rank 1] module 1 ['-n', '7']"}


@pytest.mark.timeout(30)
def test_one_failure_stops_the_rest(tmp_path, capfd):
    s = script(tmp_path, SLEEPER.replace("time.sleep(60)", """
    if os.environ["RANK"] == "1":  # fail once the others are surely asleep
        t = time.monotonic()
        while len([f for f in os.listdir(d) if f.endswith(".pid")]) < 3 and time.monotonic() - t < 20:
            time.sleep(0.01)
        with open(os.path.join(d, "failed_at"), "w") as f:
            f.write(repr(time.time()))
        raise ValueError("rank one gave up")
    time.sleep(60)"""))
    rc = main(["-n", "3", s, str(tmp_path)])
    stopped_after = time.time() - float((tmp_path / "failed_at").read_text())
    err = capfd.readouterr().err
    assert rc == 1
    # The others sleep 60 s. The launcher sees the failure within a poll, SIGTERMs them
    # (a sleeping Python dies of it at once) and would SIGKILL after watch.GRACE (3 s):
    # "within a few seconds", with room for a loaded machine.
    assert stopped_after < 4 * GRACE, stopped_after
    assert "rank 1" in err and "exited with code 1" in err
    assert "ValueError: rank one gave up" in err.split("last lines of rank 1")[1]
    pids = read_pids(tmp_path, 3)
    assert pids and not any(alive(p) for p in pids)


@pytest.mark.timeout(30)
def test_worker_killed_by_signal_is_named(tmp_path, capfd):
    s = script(tmp_path, """
        import os, signal
        print("about to die")
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    assert main(["-n", "1", s]) == 1
    err = capfd.readouterr().err
    assert "rank 0" in err and "SIGKILL" in err and "about to die" in err


@pytest.mark.timeout(30)
def test_failed_workers_exit_code_is_returned(tmp_path, capfd):
    s = script(tmp_path, """
        import os, sys
        sys.exit(7 if os.environ["RANK"] == "0" else 0)
    """)
    assert main(["-n", "2", s]) == 7
    assert "rank 0" in capfd.readouterr().err


def start_sleepers(tmp_path, n, **popen_kw):
    """Launch n sleeping workers under `python -m paratrain.run`; return (launcher, worker pids)."""
    s = script(tmp_path, SLEEPER)
    launcher = subprocess.Popen([sys.executable, "-m", "paratrain.run", "-n", str(n), s, str(tmp_path)],
                                cwd=REPO, **popen_kw)
    try:
        assert wait_until(lambda: read_pids(tmp_path, n), 40), "workers never started"
    except BaseException:
        launcher.kill()
        launcher.wait()
        kill_leftovers(tmp_path)
        raise
    return launcher, read_pids(tmp_path, n)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129),
                                       (signal.SIGQUIT, 131)])
def test_signal_to_launcher_stops_all_workers(tmp_path, sig, code):
    launcher, pids = start_sleepers(tmp_path, 3, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        launcher.send_signal(sig)
        out, err = launcher.communicate(timeout=15)
        assert launcher.returncode == code, err.decode()
        assert wait_until(lambda: not any(alive(p) for p in pids), 5), "workers outlived the launcher"
        assert signal.Signals(sig).name in err.decode()
    finally:
        launcher.kill()
        launcher.wait()
        kill_leftovers(tmp_path)


@pytest.mark.timeout(60)
def test_launcher_killed_abruptly_leaves_no_orphans(tmp_path):
    launcher, pids = start_sleepers(tmp_path, 2, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        launcher.kill()  # SIGKILL: no chance to clean up; PR_SET_PDEATHSIG must do it
        launcher.wait()
        assert wait_until(lambda: not any(alive(p) for p in pids), 5), "orphaned workers"
    finally:
        launcher.kill()
        launcher.wait()
        kill_leftovers(tmp_path)


@pytest.mark.timeout(30)
def test_missing_script(tmp_path, capfd):
    missing = str(tmp_path / "no_such_script.py")
    assert main(["-n", "2", missing]) == 2
    err = capfd.readouterr().err
    assert "no_such_script.py" in err and "not found" in err


@pytest.mark.timeout(30)
@pytest.mark.parametrize("opts, needle", [
    (["-n", "0"], "at least 1"),
    (["--threads", "0"], "at least 1"),
    (["--nnodes", "2", "--node-rank", "2"], "--node-rank"),
    (["--bogus"], "unrecognized"),
    (["--bind-to", "socket"], "invalid choice"),
    (["--timeout", "inf"], "--timeout must be"),
    (["--timeout", "nan"], "--timeout must be"),
    (["-n", "4611686018427387904"], "more workers than one machine"),
])
def test_bad_options(tmp_path, capfd, opts, needle):
    s = script(tmp_path, "print('should not run')\n")
    assert main([*opts, s]) == 2
    cap = capfd.readouterr()
    assert needle in cap.err and "should not run" not in cap.out


@pytest.mark.timeout(30)
def test_what_python_runs_runs_and_the_rest_is_named(tmp_path, capfd, monkeypatch):
    """A directory with a __main__.py runs as `python DIR` runs it; a script whose
    name starts with '-' runs (Python read it as options); a directory without
    __main__.py and a device are refused for what they are, not as 'not found'."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__main__.py").write_text("import os\nprint('app', os.environ['RANK'])\n")
    (tmp_path / "-dash.py").write_text("print('dash')\n")
    (tmp_path / "empty").mkdir()
    assert main(["-n", "1", "app"]) == 0
    assert main(["-n", "1", "--", "-dash.py"]) == 0
    assert capfd.readouterr().out.splitlines() == ["[rank 0] app 0", "[rank 0] dash"]
    assert main(["-n", "1", "empty"]) == 2
    assert "directory without a __main__.py" in capfd.readouterr().err
    assert main(["-n", "1", "/dev/null"]) == 2
    assert "not a regular file" in capfd.readouterr().err


@pytest.mark.timeout(30)
def test_a_finished_job_leaves_no_child_of_its_workers(tmp_path, capfd):
    """Every worker exits 0 but left a child (in its process group) that holds the
    output pipes: the launcher ends it, as it does when the job fails, and returns
    without waiting for it."""
    s = script(tmp_path, """
        import subprocess
        child = subprocess.Popen(["sleep", "300"])   # inherits stdout/stderr: the launcher's pipes
        print("child", child.pid, flush=True)
    """)
    assert main(["-n", "2", s]) == 0
    pids = [int(line.split()[-1]) for line in capfd.readouterr().out.splitlines() if "child" in line]
    assert len(pids) == 2
    assert wait_until(lambda: not any(alive(p) for p in pids), 5), "a worker's child outlived the job"


@pytest.mark.timeout(30)
def test_master_port_in_use(tmp_path, capfd):
    s = script(tmp_path, "print('should not run')\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["-n", "1", "--master-port", str(port), s]) == 2
    cap = capfd.readouterr()
    assert str(port) in cap.err and "pick another port" in cap.err and "should not run" not in cap.out


@pytest.mark.timeout(30)
def test_free_port_can_be_bound():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("n, code", [(2, 0), (1, 3)])
def test_leftover_shm_segments_are_removed(tmp_path, capfd, n, code):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    other = f"/dev/shm/paratrain-otherjob{os.getpid()}-keep"
    open(other, "w").close()
    s = script(tmp_path, """
        import os, sys
        path = f"/dev/shm/paratrain-{os.environ['PARATRAIN_JOB_ID']}-{os.environ['RANK']}-seg"
        open(path, "w").close()
        print(path)
        sys.exit(int(sys.argv[1]))  # as if killed during set-up: the name was never unlinked
    """)
    try:
        assert main(["-n", str(n), s, str(code)]) == code
        paths = [line.split("] ", 1)[1] for line in capfd.readouterr().out.splitlines()]
        assert len(paths) == n and not any(os.path.exists(p) for p in paths)
        assert os.path.exists(other)  # another job's segment is not ours to remove
    finally:
        os.unlink(other)


def test_cpu_sets_follow_a_narrowed_mask_in_order():
    """A taskset- or cgroup-narrowed mask (CPUs 4, 6, 7): blocks are taken from it in order."""
    cpus = [4, 6, 7]
    assert binding.cpu_sets("none", 2, 1, cpus) == [None, None]
    assert binding.cpu_sets("core", 4, 1, cpus) == [{4}, {6}, {7}, {4}]
    assert binding.cpu_sets("core", 2, 2, cpus) == [{4, 6}, {7, 4}]
    assert binding.cpu_sets("core", 1, 5, cpus) == [{4, 6, 7}]
    assert binding.oversubscribed(2, 2, cpus) and not binding.oversubscribed(3, 1, cpus)
    with pytest.raises(ValueError, match="unknown binding 'socket'"):
        binding.cpu_sets("socket", 2, 1, cpus)


def _can_link():
    from paratrain.launch.link import tool
    return os.geteuid() == 0 and all(tool(t) for t in ("unshare", "ip", "tc"))


@pytest.mark.timeout(120)
@pytest.mark.skipif(not _can_link(), reason="--link needs root and unshare, ip, tc")
def test_link_runs_pretend_hosts_in_a_namespace_with_a_limited_loopback():
    """--link 1gbit --nnodes 2 -n 2: 4 workers as 2 pretend hosts, in a network namespace
    whose loopback has a 1 Gbit/s token bucket; the host's own loopback is untouched."""
    res = subprocess.run([sys.executable, "-m", "paratrain.run", "--link", "1gbit", "--nnodes", "2", "-n", "2",
                          str(WORKERS / "link.py")], cwd=ROOT, capture_output=True, text=True, timeout=100)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    lines = [line for line in out.splitlines() if "link: rank" in line]
    assert len(lines) == 4, out[-3000:]
    for line in lines:
        assert "of 4, backend hierarchical, pretend hosts 2, all_reduce right" in line, line
        assert "tbf" in line and "rate 1Gbit" in line, line
    from paratrain.launch.link import tool
    host = subprocess.run([tool("tc"), "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout
    assert "tbf" not in host, host


@pytest.mark.timeout(30)
def test_link_says_what_it_needs(monkeypatch):
    from paratrain.launch import link
    assert "give a rate as tc writes it" in link.check("fast")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "--link needs root" in link.check("1gbit") and "not running as root" in link.check("1gbit")
