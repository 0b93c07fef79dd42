"""Running ``paratrain train`` runs one after another, for compare and plan --verify.

Each run is train's own front-end called in this process (its workers are the
launcher's, as always), with its output in ``logs/<name>.log``; all of them
start their workers from one fork server, which imported torch once.
"""
import contextlib
import os
import shutil
import subprocess

from ..launch.forkserver import TRAINING_PRELOAD as PRELOAD
from . import report
from .strategies import train_flags


@contextlib.contextmanager
def one_fork_server():
    """Every run's workers forked from one process that imported torch once
    (launch/forkserver.py), rather than each worker of each run importing it anew;
    unless PARATRAIN_FORKSERVER already names one."""
    from .. import config
    if config.get("PARATRAIN_FORKSERVER"):
        yield
        return
    from ..launch import forkserver
    address = forkserver.private_address()
    proc = forkserver.start_server(address, ",".join(PRELOAD), stderr=subprocess.DEVNULL)
    os.environ["PARATRAIN_FORKSERVER"] = address
    try:
        yield
    finally:
        os.environ.pop("PARATRAIN_FORKSERVER", None)
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(os.path.dirname(address), ignore_errors=True)


def run_one(name, flags, folder, strategy_flags=None, log=None):
    """Train ``name`` as ``paratrain train`` does, in this process (its workers are the
    launcher's, as always; this saves a Python and torch start per strategy); returns its
    row, or one saying why it did not finish. Its output goes to logs/<log or name>.log."""
    from ..train.job import main as train
    log = os.path.join(folder, "logs", f"{log or name}.log")
    before = set(os.listdir(folder))
    argv = [*flags, *(strategy_flags or train_flags(name, int(flags[flags.index("--workers") + 1])))]
    with open(log, "w") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        print("paratrain train " + " ".join(argv), flush=True)
        try:
            rc = train(argv)
        except Exception as e:   # (the run's own errors are its workers'; this is the front-end's)
            print(f"paratrain compare: {name}: {type(e).__name__}: {e}", flush=True)
            rc = 1
    made = sorted(set(os.listdir(folder)) - before)
    if rc != 0 or not made or not os.path.exists(os.path.join(folder, made[-1], "summary.json")):
        return {"strategy": name, "unavailable": f"the run failed (exit {rc}); see {log}"}
    return report.row_from_run(name, os.path.join(folder, made[-1]))
