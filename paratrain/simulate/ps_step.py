"""A parameter-server worker's step outside its compute, timed beside a real server on this host.

``beside_a_server(task, consistency)`` forks one server (ps/server.py's Server, its
heap kept as a job's server keeps it), registers the task's model with it as
one worker of ``paratrain train --strategy ps`` does; ``step_times`` times
Client.step and the zeroing of the gradients after a forward and backward of
each batch (a step's compute leaves the caches cold, as in a run). The server is
stopped with SIGTERM afterwards; its segment and doorbells were unlinked as
soon as the worker had them, so nothing is left behind. here.ps_step_seconds
caches it per model and consistency.
"""
import contextlib
import os
import time

from . import forked


def _serve(address, timeout):
    """The timing's server, its heap kept as ps/server.py's main keeps a job's (its
    registration's lines go nowhere)."""
    from ..launch.heap import keep_freed_memory
    from ..ps import wire
    from ..ps.server import Server
    keep_freed_memory()
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        Server(0, address, token=wire.token_digest(None), timeout=timeout).serve()


@contextlib.contextmanager
def beside_a_server(task, consistency, timeout=30.0):
    """(a copy of ``task``'s model, its Client) registered as one worker with a server forked
    from this process, pulled once; the server is stopped on leaving."""
    import copy
    import multiprocessing

    from ..launch.local import free_port
    from ..ps.client import Client
    from ..train.optimizer import optimizer_class
    address = f"tcp://127.0.0.1:{free_port()}"
    server = multiprocessing.get_context("fork").Process(target=_serve, args=(address, timeout), daemon=True)
    server.start()
    client = None
    try:
        worker = copy.deepcopy(task.model)
        client = Client([address], 0, 1, None, timeout)
        _, hyper = optimizer_class(task.defaults["optimizer"], task.defaults["lr"])
        with contextlib.redirect_stdout(None):   # (the placement it prints)
            client.register(worker, optimizer=task.defaults["optimizer"], consistency=consistency, **hyper)
        client.pull()
        yield worker, client
    finally:
        if client is not None:
            client.close()
        server.terminate()   # (its segment and doorbells were unlinked once the worker had them)
        forked.end([server], 10)


def step_times(task, worker, client, batches):
    """Each step's seconds outside its compute: after a forward and backward of each batch,
    Client.step and the zeroing of the gradients, as train/strategies/ps.py runs them."""
    for samples in batches:
        task.loss(worker, samples).backward()
        t0 = time.perf_counter()
        client.step(worker)
        worker.zero_grad(set_to_none=False)
        yield time.perf_counter() - t0
