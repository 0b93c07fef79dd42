"""The fork server: a worker forked from it sees what a fresh interpreter would,
ends as it would, and dies with its launcher; what it cannot start the same
way starts fresh, with a note.

These tests run their own servers with nothing preloaded (fast to start); the
suite's own server (conftest.fork_server) preloads torch and serves every
other test's launches.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from conftest import start_fork_server
from paratrain.launch import binding, forkserver
from test_launcher import alive, wait_until

SHOW = """\
    import os, sys
    print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "file": __file__,
                      "rank": os.environ["RANK"], "stdin": sys.stdin.read(), "name": __name__,
                      "ppid": os.getppid(), "pgid": os.getpgid(0), "pid": os.getpid(),
                      "unbuffered": os.environ.get("PYTHONUNBUFFERED")}), flush=True)
    print("to stderr", os.environ["RANK"], file=sys.stderr)
    sys.exit(3 + int(os.environ["RANK"]) if sys.argv[1:] == ["fail"] else 0)
"""


@pytest.fixture
def server(tmp_path):
    address = str(tmp_path / "fork.sock")
    proc = start_fork_server(address, preload="json")
    yield address, proc
    proc.kill()
    proc.wait()


def run(tmp_path, address, *args, env=None, timeout=60):
    e = dict(os.environ, PARATRAIN_TIMEOUT="30", **(env or {}))
    e.pop("PARATRAIN_FORKSERVER", None)
    if address is not None:
        e["PARATRAIN_FORKSERVER"] = address
    return subprocess.Popen([sys.executable, "-m", "paratrain.run", *args], cwd=tmp_path, env=e,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def write(tmp_path, body, name="show.py"):
    path = tmp_path / name
    path.write_text("import json\n" + textwrap.dedent(body))
    return str(path)


def reports(out):
    return sorted((json.loads(line.split("] ", 1)[1]) for line in out.splitlines() if "{" in line),
                  key=lambda r: r["rank"])


def test_a_forked_worker_sees_and_ends_as_a_fresh_one(tmp_path, server):
    address, proc = server
    path = write(tmp_path, SHOW)
    jobs = {(how, args): run(tmp_path, addr, "-n", "2", path, *args)
            for how, addr in (("fresh", None), ("forked", address)) for args in ((), ("fail",))}
    done = {key: p.communicate(timeout=60) + (p.returncode,) for key, p in jobs.items()}
    for how in ("fresh", "forked"):
        _, ok_err, ok_rc = done[how, ()]
        assert ok_rc == 0, ok_err
        assert sorted(ok_err.splitlines()) == ["[rank 0] to stderr 0", "[rank 1] to stderr 1"], ok_err
        _, fail_err, fail_rc = done[how, ("fail",)]
        assert fail_rc != 0 and ("exited with code 3" in fail_err or "exited with code 4" in fail_err), fail_err
    fresh, forked = reports(done["fresh", ()][0]), reports(done["forked", ()][0])
    for a, b in zip(fresh, forked):
        assert b["ppid"] == proc.pid != a["ppid"]            # the server's children
        assert b["pgid"] == b["pid"] and a["pgid"] == a["pid"]   # each leads its own group
        for key in ("argv", "path0", "cwd", "file", "rank", "stdin", "name", "unbuffered"):
            assert a[key] == b[key], key
    assert fresh[0]["argv"] == [path] and fresh[0]["path0"] == str(tmp_path) and fresh[0]["name"] == "__main__"


def test_a_module_run_as_with_python_m_sees_the_working_directory_first(tmp_path, server):
    address, _ = server
    write(tmp_path, SHOW, name="shown.py")
    jobs = [run(tmp_path, addr, "-n", "1", "-m", "shown", "x") for addr in (None, address)]
    fresh, forked = (reports(p.communicate(timeout=60)[0])[0] for p in jobs)
    for key in ("argv", "path0", "cwd", "file", "name"):
        assert fresh[key] == forked[key], key
    assert forked["path0"] == str(tmp_path) and forked["argv"][1:] == ["x"]


def test_what_the_server_cannot_start_alike_starts_fresh_with_a_note(tmp_path, server):
    address, proc = server
    path = write(tmp_path, SHOW)
    jobs = {"differs": run(tmp_path, address, "-n", "2", path, env={"PYTHONHASHSEED": "7"}),
            "threads": run(tmp_path, address, "--threads", "2", "-n", "2", path),
            "gone": run(tmp_path, str(tmp_path / "nobody.sock"), "-n", "2", path)}
    for how, p in jobs.items():
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        assert err.count("paratrain run: note: PARATRAIN_FORKSERVER is set, but workers start fresh") == 1, err
        assert all(r["ppid"] != proc.pid for r in reports(out)), how
        assert how != "differs" or "PYTHONHASHSEED" in err, err


def test_the_server_answers_a_bad_request_and_serves_the_next(tmp_path, server):
    address, _ = server
    for payload, fds in ((b"not json", 3), (b'{"argv": []}', 3), (b"[]", 3), (b'{"argv": []}', 0)):
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.connect(address)
            socket.send_fds(s, [payload], [1] * fds)
            assert "refused" in json.loads(s.recv(4096)), payload
    p = run(tmp_path, address, "-n", "1", write(tmp_path, SHOW))
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0 and "note" not in err, err


SLEEP = """\
    import os, time
    print(json.dumps({"pid": os.getpid(), "rank": os.environ["RANK"]}), flush=True)
    time.sleep(120)
"""


def _started(p, n):
    pids = []
    while len(pids) < n:
        line = p.stdout.readline()
        assert line, p.stderr.read()
        pids.append(json.loads(line.split("] ", 1)[1])["pid"])
    return pids


def test_workers_die_with_their_launcher_or_their_server(tmp_path, server):
    """The launcher SIGKILLed: the server kills its workers. The server SIGKILLed:
    its workers die with it (PDEATHSIG), and the launcher reports them killed."""
    address, proc = server
    path = write(tmp_path, SLEEP)
    launcher = run(tmp_path, address, "-n", "2", path)
    pids = _started(launcher, 2)
    launcher.kill()
    launcher.communicate()
    assert wait_until(lambda: not any(alive(p) for p in pids), 10), "workers outlived their launcher"

    launcher = run(tmp_path, address, "-n", "2", path)
    pids = _started(launcher, 2)
    proc.kill()
    out, err = launcher.communicate(timeout=30)
    assert wait_until(lambda: not any(alive(p) for p in pids), 10), "workers outlived their server"
    assert launcher.returncode != 0 and "was killed by SIGKILL" in err, err


def test_the_server_leaves_no_socket_after_a_polite_stop(tmp_path):
    address = str(tmp_path / "polite.sock")
    proc = start_fork_server(address, preload="")
    assert os.path.exists(address)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0
    assert not os.path.exists(address)


def test_a_command_the_bootstrap_cannot_run_as_python_would_is_not_sent():
    assert "is not `python SCRIPT` or `python -m MODULE`" in forkserver.start("/x", [sys.executable, "-c", "1"], {})
    for cmd, argv in (([sys.executable, "-m", forkserver.BOOTSTRAP, "s.py", "-x"], ["s.py", "-x"]),
                      ([sys.executable, "-m", "pkg.mod", "a"], ["-m", "pkg.mod", "a"]),
                      ([sys.executable, "s.py"], ["s.py"]),
                      ([sys.executable, "-u", "s.py"], None), (["/other/python", "s.py"], None),
                      ([sys.executable, "-m"], None)):
        assert forkserver.bootstrap_argv(cmd) == argv, cmd
    assert "no fork server at /nonexistent" in forkserver.start(
        "/nonexistent", [sys.executable, "-m", forkserver.BOOTSTRAP, "x.py"], {}, stdin=0, stdout=1, stderr=2)


def test_start_up_variables_are_the_ones_named():
    env = {"PYTHONPATH": "a", "OMP_NUM_THREADS": "1", "RANK": "0", "PARATRAIN_TIMEOUT": "3", "LD_PRELOAD": "x"}
    assert forkserver.startup_env(env) == {"PYTHONPATH": "a", "OMP_NUM_THREADS": "1", "LD_PRELOAD": "x"}


def test_a_launcher_forked_from_the_server_has_its_workers_forked_too(tmp_path):
    """A front-end forked from the server inherits what the preload put in the
    environment (torch._dynamo sets TORCHINDUCTOR_CACHE_DIR); its workers still fork."""
    address = str(tmp_path / "nested.sock")
    proc = start_fork_server(address, preload="torch._dynamo")
    try:
        path = write(tmp_path, SHOW)
        env = dict(os.environ, PARATRAIN_FORKSERVER=address, PARATRAIN_TIMEOUT="30", **binding.interpreter_env(1))
        with open(tmp_path / "out", "w+b") as out, open(tmp_path / "err", "w+b") as err:
            front = forkserver.start(address, [sys.executable, "-m", "paratrain.run", "-n", "2", path], env,
                                     cwd=tmp_path, stdin=0, stdout=out.fileno(), stderr=err.fileno())
            assert front.wait(60) == 0, (tmp_path / "err").read_text()
        assert "note" not in (tmp_path / "err").read_text()
        assert [r["ppid"] for r in reports((tmp_path / "out").read_text())] == [proc.pid, proc.pid]
    finally:
        proc.kill()
        proc.wait()


def test_every_launch_in_one_process_says_once_why_its_workers_start_fresh(tmp_path, capfd, monkeypatch):
    from paratrain.launch import main
    monkeypatch.setenv("PARATRAIN_FORKSERVER", str(tmp_path / "nobody.sock"))
    path = write(tmp_path, SHOW)
    for _ in range(2):
        assert main(["-n", "2", path]) == 0
        err = capfd.readouterr().err
        assert err.count("paratrain run: note: PARATRAIN_FORKSERVER is set, but workers start fresh: no fork "
                         "server at") == 1, err


def test_a_socket_under_a_deep_temporary_directory_goes_under_tmp(tmp_path, monkeypatch):
    """A Unix socket's path holds at most 107 bytes: under a TMPDIR deeper than that leaves
    room for, the server's private folder is made under /tmp instead (a pytest folder under
    xdist is one such TMPDIR)."""
    import shutil
    import tempfile
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    fits = len(os.fsencode(str(tmp_path))) + len("/paratrain-fork-12345678/server.sock") <= forkserver.SUN_PATH_MAX
    for where, expected in ((deep, "/tmp"), (tmp_path, str(tmp_path) if fits else "/tmp")):
        monkeypatch.setattr(tempfile, "tempdir", str(where))
        address = forkserver.private_address()
        try:
            assert len(os.fsencode(address)) <= forkserver.SUN_PATH_MAX
            assert os.path.dirname(os.path.dirname(address)) == expected
            assert os.stat(os.path.dirname(address)).st_mode & 0o777 == 0o700
        finally:
            shutil.rmtree(os.path.dirname(address))
    assert not list(deep.iterdir())   # the folder it could not use is gone
