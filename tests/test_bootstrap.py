"""launch/bootstrap.py: a worker's script runs as under ``python``, and once it
has finished, a crash in the interpreter's teardown cannot turn it into a failure.

Each case runs the same script under plain ``python`` and under the bootstrap
and compares exit status and output, so the reference is Python itself.
"""
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from paratrain.launch import main as launch

pytestmark = pytest.mark.timeout(60)

# Everything a script can observe about how it was started, and how it ends.
PROBE = """
    import atexit, os, sys, threading, time
    import __main__
    print("argv", sys.argv)
    print("path0", sys.path[0])
    print("file", __file__, __main__.__file__ == __file__, __name__, __spec__, type(__loader__).__name__)
    print("globals", sorted(globals()))
    out = open(os.path.join(os.path.dirname(__file__), "unclosed.txt"), "w")
    out.write("written, never closed")       # kept: finalization would flush it, so must we
    def slow():
        time.sleep(0.3)
        print("non-daemon thread done")      # joined before the atexit handlers, as Python does
    threading.Thread(target=slow).start()
    atexit.register(lambda: print("atexit, main has __file__:", hasattr(sys.modules["__main__"], "__file__"),
                                  "last exception:", repr(getattr(sys, "last_value", None))))
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    def fail():
        raise ValueError("boom")
    if mode == "exit3":
        sys.exit(3)
    if mode == "exit-text":
        sys.exit("a message instead of a code")
    if mode == "exit-negative":
        sys.exit(-1)
    if mode == "exit-text-no-stderr":
        sys.stderr = None
        sys.exit("said on the process's stderr")
    if mode == "raise":
        fail()
    if mode == "interrupt":
        raise KeyboardInterrupt
"""


def _default_sigint():
    """A shell running the suite in the background starts it with SIGINT ignored, which
    every child inherits (Python then installs no KeyboardInterrupt handler): the
    scripts start as from a terminal, with SIGINT's default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run(cmd, cwd, env=None):
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=30,
                       preexec_fn=_default_sigint)
    return p.returncode, p.stdout, p.stderr


def both(tmp_path, target, *args, cwd=None, env=None):
    """(python's result, the bootstrap's result) for ``target args``."""
    cwd = cwd or tmp_path
    plain = run([sys.executable, *target, *args], cwd, env)
    unlink(tmp_path / "unclosed.txt")
    boot = run([sys.executable, "-m", "paratrain.launch.bootstrap", *target, *args], cwd, env)
    return plain, boot


def unlink(path):
    if path.exists():
        path.unlink()


@pytest.mark.parametrize("mode", ["", "exit3", "exit-text", "exit-negative", "exit-text-no-stderr", "raise",
                                  "interrupt"])
def test_a_script_starts_and_ends_as_under_python(tmp_path, mode):
    (tmp_path / "sub").mkdir()
    path = tmp_path / "sub" / "probe.py"
    path.write_text(textwrap.dedent(PROBE))
    plain, boot = both(tmp_path / "sub", ["sub/probe.py"], *([mode] if mode else []), cwd=tmp_path)
    assert boot == plain
    assert (tmp_path / "sub" / "unclosed.txt").read_text() == "written, never closed"
    expected = {"": 0, "exit3": 3, "exit-text": 1, "exit-negative": 255, "exit-text-no-stderr": 1, "raise": 1,
                "interrupt": -signal.SIGINT}[mode]
    assert boot[0] == expected
    if mode == "raise":
        assert "bootstrap" not in boot[2] and 'raise ValueError("boom")' in boot[2]


def test_a_module_a_directory_and_a_zip_run_as_under_python(tmp_path):
    pkg = tmp_path / "pkg" / "app"
    pkg.mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text("import sys\nprint(sys.argv, sys.path[0], __name__, __file__, sorted(globals()))\n")
    for target in (["-m", "pkg.app"], ["pkg/app"]):
        plain, boot = both(tmp_path, target, "x", "--flag")
        assert boot == plain and boot[0] == 0, target
    import zipfile
    with zipfile.ZipFile(tmp_path / "app.zip", "w") as z:
        z.write(pkg / "__main__.py", "__main__.py")
    plain, boot = both(tmp_path, ["app.zip"], "y")
    assert boot == plain and boot[0] == 0
    plain, boot = both(tmp_path, ["-m", "no_such_module_here"])
    assert boot == plain and boot[0] == 1 and "No module named no_such_module_here" in boot[2]
    plain, boot = both(tmp_path, ["no_such_script.py"])
    assert boot == plain and boot[0] == 2 and "can't open file" in boot[2]


def test_under_python_P_sys_path_is_as_under_python(tmp_path):
    """-P (PYTHONSAFEPATH) keeps a script's directory off sys.path; a directory
    or zip still goes first. Nothing of PYTHONPATH may be lost."""
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__main__.py").write_text("import sys\nprint(sys.path)\n")
    (tmp_path / "show_path.py").write_text("import sys\nprint(sys.path)\n")
    libs = str(tmp_path / "libs")
    env = {**os.environ, "PYTHONSAFEPATH": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [libs, os.environ.get("PYTHONPATH")]))}
    for target in (["show_path.py"], ["app"]):
        plain, boot = both(tmp_path, target, env=env)
        assert boot == plain and boot[0] == 0 and libs in boot[1], target


# stdout becomes a pipe nobody reads; what was printed is still in its buffer
# when the script ends, so the flush at exit fails: Python says so, and exits 120.
STDOUT_LOST = """
    import os, sys
    read_end, write_end = os.pipe()
    os.dup2(write_end, 1)
    os.close(read_end)
    print("never read")
    sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("code", [0, 3])
def test_output_that_cannot_be_flushed_at_exit_is_reported_as_under_python(tmp_path, code):
    (tmp_path / "lost.py").write_text(textwrap.dedent(STDOUT_LOST))
    buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}   # as a plain shell gives
    plain, boot = both(tmp_path, ["lost.py"], str(code), env=buffered)
    assert boot == plain
    assert boot[0] == 120 and "Exception ignored in: <_io.TextIOWrapper name='<stdout>'" in boot[2]
    assert "BrokenPipeError" in boot[2]


# What a script leaves open or alive when it ends: finalization frees its
# globals, and their __del__ methods finish the work (a gzip trailer, a zip's
# central directory, a NamedTemporaryFile removed, a last message).
LEFT_OPEN = """
    import gc, gzip, os, sys, tempfile, zipfile
    if sys.argv[1:] == ["no-gc"]:
        gc.disable()   # nothing reorders the objects before the exit's collection frees them
    def fail():
        raise RuntimeError("the traceback holds this frame, and through it the globals")
    def helper():   # a function refers back to the globals: the cycle collector frees them
        pass
    class Goodbye:
        def __del__(self):
            print("goodbye from __del__, os is still", type(os).__name__)
    scratch = tempfile.NamedTemporaryFile(dir=".", prefix="scratch")
    goodbye = Goodbye()
    archive = zipfile.ZipFile("archive.zip", "w")
    archive.writestr("a.txt", "zip text")
    text = open("plain.txt", "w")
    text.write("plain text")
    packed = gzip.open("packed.gz", "wt")
    packed.write("gzip text")
    print("done")
    if sys.argv[1:] == ["raise"]:
        fail()
"""


@pytest.mark.parametrize("args", [[], ["no-gc"], ["raise"]])
def test_what_the_script_left_open_is_completed_at_exit_as_under_python(tmp_path, args):
    import gzip
    import zipfile
    (tmp_path / "left_open.py").write_text(textwrap.dedent(LEFT_OPEN))
    results = []
    for cmd in ([sys.executable], [sys.executable, "-m", "paratrain.launch.bootstrap"]):
        rc, out, err = run([*cmd, "left_open.py", *args], tmp_path)
        files = ((tmp_path / "plain.txt").read_text(), gzip.open(tmp_path / "packed.gz", "rt").read(),
                 zipfile.ZipFile(tmp_path / "archive.zip").read("a.txt"), sorted(tmp_path.glob("scratch*")))
        results.append((rc, out, err, files))
        for name in ("plain.txt", "packed.gz", "archive.zip"):
            unlink(tmp_path / name)
    plain, boot = results
    assert boot[0] == (1 if args == ["raise"] else 0)
    assert boot[1] == "done\ngoodbye from __del__, os is still module\n"
    assert boot[3] == ("plain text", "gzip text", b"zip text", [])
    if args != ["no-gc"]:   # there Python loses the text still in the wrappers; the bootstrap flushes it first
        assert plain == boot


# Once the exit has begun (here: a global's __del__ as the globals are freed),
# Python has given every signal back its default action, so a SIGTERM from the
# launcher or a Ctrl-C ends the process, whatever handler the script had set.
SIGNALLED_AT_EXIT = """
    import os, signal, sys
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(42))   # a training script's "save, then exit"
    SIGNAL = getattr(signal, sys.argv[1])
    class SignalsAtExit:
        def __del__(self):
            os.kill(os.getpid(), SIGNAL)
    keep = SignalsAtExit()
    print("done")
"""


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_a_signal_during_the_exit_ends_the_process_as_under_python(tmp_path, name):
    (tmp_path / "signalled.py").write_text(textwrap.dedent(SIGNALLED_AT_EXIT))
    plain, boot = both(tmp_path, ["signalled.py"], name)
    assert boot == plain == (-getattr(signal, name), "done\n", "")


# A signal while the exit waits for the script's threads: what its handler
# raises (SystemExit from a "save, then exit" handler; KeyboardInterrupt) is
# reported as ignored and the exit goes on with the script's status, as Python does.
SIGNALLED_WHILE_JOINING = """
    import signal, sys, threading, time
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(42))
    def signal_main_once_it_joins():
        while threading.main_thread().is_alive():   # until the script is over
            time.sleep(0.01)
        signal.pthread_kill(threading.main_thread().ident, getattr(signal, sys.argv[1]))
        threading.Event().wait()   # never ends: the exit must go on without this thread
    threading.Thread(target=signal_main_once_it_joins).start()
    print("done")
"""


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_a_signal_while_threads_are_joined_is_reported_as_under_python(tmp_path, name):
    (tmp_path / "joining.py").write_text(textwrap.dedent(SIGNALLED_WHILE_JOINING))
    plain, boot = both(tmp_path, ["joining.py"], name)
    assert boot == plain
    assert boot[0] == 0 and boot[2].startswith("Exception ignored in: <module 'threading'")


# A script's sys.excepthook that breaks, or ends the process itself. The library
# object that aborts in teardown shows that the bootstrap still ends the process.
HOOKED = """
    import json, os, sys
    class FreedAtFinalization:
        def __del__(self):
            os.abort()
    json.held_by_a_library = FreedAtFinalization()
    def hook(*exc_info):
        if sys.argv[1] == "exits":
            sys.exit(5)
        raise RuntimeError("the hook broke")
    sys.excepthook = hook
    raise ValueError("the script broke")
"""


@pytest.mark.parametrize("mode", ["breaks", "exits"])
def test_a_failing_excepthook_is_reported_as_under_python(tmp_path, mode):
    (tmp_path / "hooked.py").write_text(textwrap.dedent(HOOKED))
    plain, boot = both(tmp_path, ["hooked.py"], mode)
    assert boot[1:] == plain[1:] and plain[0] == -signal.SIGABRT
    assert boot[0] == {"breaks": 1, "exits": 5}[mode]
    if mode == "breaks":
        assert boot[2].startswith("Error in sys.excepthook:") and "Original exception was:" in boot[2]


# A script's own stand-in for sys.stdout and sys.stderr with no .closed, as
# "tee to a log file" classes often are: Python's exit skips flushing them.
TEE = """
    import sys
    class Tee:
        def __init__(self, *streams):
            self.streams = streams
        def write(self, text):
            for stream in self.streams:
                stream.write(text)
        def flush(self):
            for stream in self.streams:
                stream.flush()
    log = open("tee.log", "w")
    sys.stdout = Tee(sys.stdout, log)
    sys.stderr = Tee(sys.stderr, log)
    print("to the terminal and the log")
"""


def test_a_replaced_stdout_without_closed_ends_as_under_python(tmp_path):
    (tmp_path / "tee.py").write_text(textwrap.dedent(TEE))
    plain, boot = both(tmp_path, ["tee.py"])
    assert boot == plain == (0, "to the terminal and the log\n", "")
    assert (tmp_path / "tee.log").read_text() == "to the terminal and the log\n"


# A library object whose every attribute lookup warns, as torch.distributed.reduce_op
# does: the exit must not look it up (isinstance would, through __class__).
DEPRECATED = """
    import warnings
    class Deprecated:
        def __getattribute__(self, name):
            warnings.warn(f"{name} is deprecated", FutureWarning)
            return object.__getattribute__(self, name)
    reduce_op = Deprecated()
"""


def test_the_exit_does_not_look_up_attributes_of_a_librarys_objects(tmp_path):
    (tmp_path / "deprecated.py").write_text(textwrap.dedent(DEPRECATED))
    (tmp_path / "uses.py").write_text("import deprecated\nprint('done')\n")
    plain, boot = both(tmp_path, ["uses.py"])
    assert boot == plain == (0, "done\n", "")


# A crash in the interpreter's teardown, after the script has printed its
# result: what Gloo's worker thread does now and then (docs/exit-abort.md),
# made certain. The object is held by a library module, as torch holds its
# process groups: only finalization frees it (the script's own globals are
# freed at exit under the bootstrap too, as under python).
CRASHES_IN_TEARDOWN = """
    import json, os
    class FreedAtFinalization:
        def __del__(self):
            os.abort()
    json.held_by_a_library = FreedAtFinalization()
    print("result", os.environ.get("RANK", "-"))
"""


def test_a_crash_in_teardown_does_not_fail_a_finished_script(tmp_path):
    path = tmp_path / "teardown.py"
    path.write_text(textwrap.dedent(CRASHES_IN_TEARDOWN))
    plain, boot = both(tmp_path, [str(path)])
    assert plain[0] == -signal.SIGABRT, "the control: plain python dies in teardown"
    assert boot[0] == 0 and boot[1] == plain[1] == "result -\n"


def test_paratrain_run_reports_a_finished_job_as_success(tmp_path, capfd):
    path = tmp_path / "teardown.py"
    path.write_text(textwrap.dedent(CRASHES_IN_TEARDOWN))
    assert launch(["-n", "2", str(path)]) == 0
    out = capfd.readouterr().out
    assert "[rank 0] result 0" in out and "[rank 1] result 1" in out


def test_paratrain_run_still_reports_a_failure_inside_the_script(tmp_path, capfd):
    path = tmp_path / "fails.py"
    path.write_text("import os, sys\nif os.environ['RANK'] == '1':\n    raise RuntimeError('rank 1 broke')\n")
    assert launch(["-n", "2", str(path)]) == 1
    err = capfd.readouterr().err
    assert "RuntimeError: rank 1 broke" in err and "rank 1" in err and "bootstrap" not in err


def test_a_script_under_mpirun_finalizes_mpi(tmp_path):
    """mpi4py's MPI_Finalize runs in the interpreter's own finalization, which the
    bootstrap skips: without finalize_mpi(), mpirun reports the job as failed."""
    pytest.importorskip("mpi4py")
    from paratrain.bench.launcher import find_mpirun
    mpirun = find_mpirun()
    if mpirun is None:
        pytest.skip("no mpirun")
    path = tmp_path / "mpi_script.py"
    path.write_text("from mpi4py import MPI\nprint('rank', MPI.COMM_WORLD.Get_rank(), flush=True)\n")
    p = subprocess.run([mpirun, "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable, "-m",
                        "paratrain.launch.bootstrap", str(path)], capture_output=True, text=True, timeout=50)
    assert p.returncode == 0, p.stdout + p.stderr
    assert sorted(p.stdout.split("\n")[:2]) == ["rank 0", "rank 1"]
