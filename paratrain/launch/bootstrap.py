"""Run a worker's script as ``python`` would, then end the process without
the interpreter's own teardown, so a script that has finished stays finished.

    python -m paratrain.launch.bootstrap script.py args...
    python -m paratrain.launch.bootstrap -m package.module args...

Why: a finished torch.distributed script can still die at exit. Gloo's worker
thread (``ProcessGroupGloo::runLoop``) may drop the last reference to a
finished Work after the main thread has entered ``Py_FinalizeEx``; the Work's
destructor decrefs its tensors' Python objects, which needs the GIL, and a
thread that asks for the GIL during finalization is ended by CPython with
``pthread_exit``. That forced unwind crosses a ``noexcept`` destructor, so
C++ calls ``std::terminate`` ("terminate called without an active
exception") and the whole process gets SIGABRT after the script printed its
result (docs/exit-abort.md has the backtrace). torchrun has the same crash.

So once the script is over we do what the interpreter's exit does that a
user can see, in the same order, and stop short of finalization:
non-daemon threads joined (and ``threading``'s own exit hooks), ``atexit``
handlers run, sys.stdout and sys.stderr flushed (exit 120 if that fails),
signals back to their default actions, the script's own globals freed (their
``__del__`` methods run), every open writable stream flushed, then
``os._exit``. The interpreter and the libraries' state are never torn down,
so no thread can be ended mid-destructor.

What a script sees is what ``python script.py`` gives it: ``sys.argv``,
``sys.path[0]`` (the script's directory; the working directory with ``-m``),
``__main__`` with ``__file__``, a directory or zip with ``__main__.py``, and
``runpy``'s own ``-m`` semantics. How it ends is reported as Python reports
it: the exit code of ``sys.exit``, a traceback and exit 1 for an exception
(without this file's frames), death by SIGINT for an unhandled Ctrl-C.
"""
import atexit
import gc
import io
import os
import runpy
import signal
import sys
import threading
import types
from importlib.machinery import SourceFileLoader

from . import heap

USAGE = "usage: python -m paratrain.launch.bootstrap (SCRIPT | -m MODULE) [ARGS...]"
FORKED_FROM = None   # the pid of the fork server this process is a fork of (forkserver.py sets it), else None


def main(argv):
    if not argv or argv[0] == "-m" and len(argv) < 2:
        print(USAGE, file=sys.stderr)
        return 2
    heap.keep_freed_memory()   # before the script allocates (heap.py: why)
    try:
        if argv[0] == "-m":
            run_module(argv[1], argv[2:])
        else:
            run_script(argv[0], argv[1:])
    except SystemExit as e:
        return exit_code(e.code)
    except BaseException as e:  # noqa: BLE001 - reported as the interpreter reports it
        error = e
    else:
        return 0
    return report(error)   # out of the except block: an error in the hook is not chained to it


def run_script(path, args):
    """``python path args``: a file runs in a fresh ``__main__``; a directory or
    zip runs its ``__main__.py`` as a module, with itself first on sys.path."""
    sys.argv = [path, *args]
    if os.path.isdir(path) or not path.endswith(".py") and _is_zip(path):
        _first_on_path(os.path.abspath(path))
        _fresh_main(None)   # not in ours: the script must neither see nor replace our globals
        _run_main_module("__main__", alter_argv=False)
        return
    filename = os.path.abspath(path)       # Python 3.9+: __main__.__file__ is absolute
    try:
        with io.open_code(filename) as f:
            source = f.read()
    except OSError as e:
        print(f"{sys.executable}: can't open file {filename!r}: [Errno {e.errno}] {e.strerror}", file=sys.stderr)
        raise SystemExit(2) from None   # Python's words and status for a script it cannot open
    if not sys.flags.safe_path:   # python -P (PYTHONSAFEPATH) leaves the script's directory out
        _first_on_path(os.path.dirname(os.path.realpath(path)))
    main_module = _fresh_main(filename)
    try:
        exec(compile(source, filename, "exec"), main_module.__dict__)
    except SystemExit:
        raise   # CPython exits from inside the run here, leaving __file__ in place
    except BaseException:
        _forget_file(main_module)
        raise
    _forget_file(main_module)


def _first_on_path(entry):
    """Put entry first on sys.path as python does for a script: in place of the
    working directory our own -m put there, or ahead of all under -P, where
    -m put nothing."""
    if sys.flags.safe_path:
        sys.path.insert(0, entry)
    else:
        sys.path[0] = entry


def _forget_file(module):
    """CPython deletes __main__'s __file__ and __cached__ once the script is over."""
    module.__dict__.pop("__file__", None)
    module.__dict__.pop("__cached__", None)


def run_module(name, args):
    """``python -m name args``: sys.path[0] is already the working directory,
    as ``python -m`` sets it; sys.argv[0] becomes the module's file."""
    sys.argv = ["-m", *args]
    _fresh_main(None)
    _run_main_module(name, alter_argv=True)


def _fresh_main(filename):
    """A new ``__main__`` module in sys.modules (ours stays alive in _OURS)."""
    module = types.ModuleType("__main__")
    module.__dict__.update(__builtins__=__builtins__, __cached__=None, __spec__=None, __annotations__={})
    if filename is not None:
        module.__file__ = filename
        module.__loader__ = SourceFileLoader("__main__", filename)
    sys.modules["__main__"] = module
    return module


def _run_main_module(name, alter_argv):
    """What ``python -m`` itself calls: the module runs in ``sys.modules['__main__']``,
    not in a temporary module, so ``__main__`` is still it when atexit runs."""
    return runpy._run_module_as_main(name, alter_argv)


def _is_zip(path):
    import zipfile
    return os.path.isfile(path) and zipfile.is_zipfile(path)


def exit_code(code):
    """sys.exit's argument as Python turns it into an exit status."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:   # Python writes to the process's stderr when sys.stderr is None
        print(code, file=sys.stderr if sys.stderr is not None else sys.__stderr__)
    except Exception:  # noqa: BLE001 - no stderr to write to: the status is still 1
        pass
    return 1


def report(exc):
    """Report an exception the script did not catch as Python does, and return
    the exit status: 1, or death by SIGINT for a KeyboardInterrupt. Its traceback
    starts at the script's own frames and is kept in sys.last_*; sys.excepthook
    prints it. A hook that fails has both printed by the default hook; a hook
    that calls sys.exit decides the status."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in _OWN_FILES:
        tb = tb.tb_next
    exc = exc.with_traceback(tb)   # the default hook prints exc.__traceback__
    sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, tb
    try:
        sys.excepthook(type(exc), exc, tb)
    except SystemExit as e:
        return exit_code(e.code)
    except BaseException as hook_error:  # noqa: BLE001 - reported as the interpreter reports it
        print("Error in sys.excepthook:", file=sys.stderr)
        hook_tb = hook_error.__traceback__.tb_next   # from the hook's own frame
        sys.__excepthook__(type(hook_error), hook_error.with_traceback(hook_tb), hook_tb)
        print("\nOriginal exception was:", file=sys.stderr)
        sys.__excepthook__(type(exc), exc, tb)
    return -signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1


def finish(status):
    """End the process as the interpreter's exit would, minus finalization (see
    the module docstring): threads joined, atexit handlers, streams flushed,
    then os._exit. A negative status is death by that signal, as Python dies of
    a KeyboardInterrupt the script did not catch."""
    try:
        threading._shutdown()   # threading's exit hooks, then non-daemon threads joined
    except BaseException as exc:  # noqa: BLE001 - a signal's exception while joining: Python says so, goes on
        unraisable(exc.with_traceback(exc.__traceback__.tb_next), threading)
    atexit._run_exitfuncs()
    if not flush_std_streams() and status >= 0:
        status = 120   # Python's status when sys.stdout or sys.stderr cannot be flushed at exit
    default_signal_handlers()
    flush_open_streams()   # first: the collector may free a file before the text wrapper over it
    free_main()
    flush_open_streams()   # then what their __del__ methods wrote
    finalize_mpi()
    if status < 0:
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    os._exit(status)


def finalize_mpi():
    """MPI_Finalize, if mpi4py initialized MPI: mpi4py calls it from a C-level exit
    hook of the interpreter's finalization, which os._exit skips, and mpirun
    reports a rank that exits without it as a failed job."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()


def flush_std_streams():
    """Flush sys.stdout then sys.stderr as Py_FinalizeEx does after the atexit
    handlers; False if one failed (stdout a pipe whose reader is gone). A
    failure of stdout is reported as Python reports an unraisable exception."""
    flushed = True
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is None or stream.closed:
                continue
        except Exception:  # noqa: BLE001 - no .closed (a script's own Tee object): Python skips it
            continue
        try:
            stream.flush()
        except Exception as exc:  # noqa: BLE001 - any error, as the interpreter's own flush
            flushed = False
            if stream is sys.stdout:
                unraisable(exc.with_traceback(None), stream)   # raised in C: no traceback
    return flushed


def unraisable(exc, obj):
    """Print exc, raised in obj, as sys.unraisablehook's default does."""
    import traceback
    kind = type(exc).__qualname__
    if type(exc).__module__ != "builtins":
        kind = f"{type(exc).__module__}.{kind}"
    tb = ["Traceback (most recent call last):\n", *traceback.format_tb(exc.__traceback__)] if exc.__traceback__ else []
    try:
        sys.stderr.write("".join([f"Exception ignored in: {obj!r}\n", *tb, f"{kind}: {exc}\n"]))
    except Exception:  # noqa: BLE001 - stderr broken too: nothing can be said
        pass


def default_signal_handlers():
    """As finalization begins, Python gives every signal it handles back to the
    default action: a SIGTERM or Ctrl-C from here on ends the process at once."""
    for sig in signal.valid_signals():
        if callable(signal.getsignal(sig)):
            signal.signal(sig, signal.SIG_DFL)


def free_main():
    """Free the script's globals as finalization does, so that what their
    __del__ methods do happens (an unclosed gzip or zip file is completed, a
    NamedTemporaryFile removed): __main__ leaves sys.modules and is collected,
    its finalizers seeing it whole. What something else still holds stays, as
    under Python. Only __main__: the libraries' state (torch's process groups,
    the threads that serve them) is what must not be torn down."""
    sys.last_type = sys.last_value = sys.last_traceback = None   # Python's first step: they hold frames
    sys.modules.pop("__main__", None)
    gc.collect()


def flush_open_streams():
    """Flush sys.stdout/stderr and every other open writable buffered file, as
    finalization does when it frees them (a file the script never closed keeps
    what was written to it)."""
    streams = [sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__]
    files = (io.BufferedWriter, io.BufferedRandom, io.TextIOWrapper)
    # type(o), not isinstance(o, files): isinstance falls back to looking up o.__class__,
    # which runs code on proxies (torch.distributed.reduce_op warns on every exit)
    streams += [o for o in gc.get_objects() if issubclass(type(o), files)]
    for stream in streams:
        try:
            if stream is not None and not stream.closed and stream.writable():
                stream.flush()
        except Exception:  # noqa: BLE001 - a closed pipe or a broken file; the rest still get flushed
            pass


_OWN_FILES = {__file__, runpy.__file__, "<frozen runpy>"}
_OURS = sys.modules.get(__name__)

if __name__ == "__main__":
    finish(main(sys.argv[1:]))
