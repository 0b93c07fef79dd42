"""A fork server of a launcher's own, started in the background (forkserver.py).

    warm = WarmStart(os.environ, preload=TRAINING_PRELOAD)   # first thing: it imports while we do
    ...
    if warm.ready(timeout=60):
        os.environ["PARATRAIN_FORKSERVER"] = warm.address      # the launcher forks workers from it
    ...
    warm.stop()

Why: a fresh worker spends seconds of CPU importing torch (and torch._dynamo at
its first optimizer step, matplotlib for its plot), and N workers and their
parameter servers started together on fewer cores pay it one after another.
Started first, the server imports once, beside whatever its launcher still
does (``paratrain train``'s front-end imports torch itself to check the
options), and every worker is then a fork of it. Until it listens a worker
starts fresh, so ``ready`` says when it does. It dies with its launcher.
"""
import os
import shutil
import subprocess

from . import forkserver


class WarmStart:
    def __init__(self, env, preload=forkserver.DEFAULT_PRELOAD, threads=1):
        self.address = forkserver.private_address()
        self._ready = False
        self.proc = forkserver.spawn_server(self.address, ",".join(preload), env, threads, stderr=subprocess.DEVNULL)

    def ready(self, timeout=0.0):
        """Whether it listens, waiting up to ``timeout`` seconds for it to say so."""
        if not self._ready:
            self._ready = forkserver.listening(self.proc, timeout)
        return self._ready

    def stop(self):
        self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()
        shutil.rmtree(os.path.dirname(self.address), ignore_errors=True)
