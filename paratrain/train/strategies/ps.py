"""``--strategy ps``: the trainer's step over the parameter server.

Where DataParallel averages gradients among the workers and each worker runs
its own optimizer, here the optimizer runs on the servers: every step a
worker pulls the current weights (waiting as the consistency model says),
computes its gradient, pushes it and advances its clock. Nothing is
all-reduced among workers, so in ASP and SSP a fast worker is not held back
by the loss logging either: the logged loss is rank 0's own batches'.

The workers do not form a process group: they meet in a TCPStore that rank 0
serves (coordination.StoreBoard), and under ASP and SSP they draw the job's
batches from a shared pool there, so a fast worker takes more of them.

Workers run under SCHED_BATCH (Linux; any user may choose it, and
PARATRAIN_PS_SCHED_BATCH=0 keeps the default policy). A server answers the
workers of a BSP round one after another, and without it the first worker
it wakes takes the server's core on the spot (the scheduler favours a task
that slept), so the next answer waits behind that worker's compute; tasks
under SCHED_BATCH do not preempt on wake-up. Compute-bound workers are what
that policy is for.
"""
import argparse
import math
import os

import paratrain as pt

from ... import config
from ...comm.group import timeout_from_env
from ...parallel.data import CommStats
from ..argtypes import positive_int
from ..coordination import Lockstep, SharedPool, StoreBoard
from ..optimizer import optimizer_class
from .base import ReplicaStep

HELP = "ps: parameter server (optimizer on the servers)"
SPARSE = True   # recsys keeps its embedding rows on the servers (pt.ps.Embedding)
COMPRESSES = {"ps": "pushes"}
NO_RESUME = "--resume with --strategy ps is not available yet (the optimizer state lives on the servers)"


def staleness_bound(text):
    """--staleness: a whole number of clocks, or inf (no bound: SSP then behaves like ASP)."""
    if text.strip().lower() in ("inf", "infinity"):
        return math.inf
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of clocks or inf, got {text!r}") from None


def add_options(parser):
    g = parser.add_argument_group("--strategy ps")
    g.add_argument("--servers", type=positive_int, default=1, help="parameter servers (default 1)")
    g.add_argument("--consistency", choices=("bsp", "asp", "ssp"), default="bsp",
                   help="bsp (synchronous), asp (asynchronous), ssp (bounded staleness)")
    g.add_argument("--staleness", type=staleness_bound, default=None,
                   help="--consistency ssp: how many clocks ahead a worker may run of the slowest (0 behaves like "
                        "bsp, inf like asp)")
    g.add_argument("--predict-weights", action="store_true",
                   help="--consistency asp/ssp: workers compute on the weights their push will most likely meet, "
                        "extrapolated along the last update, a momentum step further (SpecTrain's weight "
                        "prediction with Nesterov's look-ahead; ps/shard.py)")


def check(args, chosen):
    """Its options make sense only together, and only with this strategy: a consistency
    model or a weight prediction given to another strategy is refused, not ignored."""
    if chosen and args.resume:
        return NO_RESUME
    if chosen and args.compression.startswith("powersgd"):
        return ("--compression powersgd does not work with --strategy ps: its second factor needs every worker's "
                "first factor averaged first (an all-reduce among workers); the servers take topk:<ratio>, onebit, "
                "fp16 or bf16")
    if args.consistency == "ssp" and (args.staleness is None or args.staleness < 0):
        return "--consistency ssp needs --staleness N (N >= 0; 0 behaves like bsp, inf like asp)"
    if not chosen and (args.consistency != "bsp" or args.staleness is not None):
        return "--consistency and --staleness are for --strategy ps"
    if args.predict_weights and (not chosen or args.consistency == "bsp"
                                 or (args.consistency == "ssp" and args.staleness == 0)):
        return "--predict-weights is for --strategy ps with --consistency asp or ssp (staleness > 0)"
    return None


def launcher_args(args):
    """The launcher starts the servers beside the workers. Under ASP and SSP no worker
    waits for another, so when one dies the others go on and take its share of the
    batches (coordination.py); under BSP they would block on it, so the launcher stops
    the job. Continuing is asked for only when this launcher knows the option. Rank 0
    is the exception: it hosts the job's store and writes the summary, so when it dies
    the job cannot continue."""
    words = ["--servers", str(args.servers)]
    if args.consistency == "bsp":
        return words
    from ...launch.local import build_parser
    if "--worker-failure" not in build_parser().format_help():
        return words
    return words + ["--worker-failure", "continue"]


def backend(args):
    return (f"zeromq, {args.servers} servers, {args.consistency}"
            + (f" s={args.staleness}" if args.consistency == "ssp" else "")
            + (", weight prediction" if args.predict_weights else "")
            + (f", pushes {args.compression}" if args.compression != "none" else ""))


SUMMARY = {
    "backend": lambda step, args: backend(args),
    "algorithm": lambda step, args: args.algorithm or "default",   # (no all-reduce here: --algorithm as given)
    "staleness_histogram": lambda step, args: step.staleness_histogram(),
    # rank 0's gradient bytes to the servers (compressed with --compression; the pulls are not)
    "bytes_pushed": lambda step, args: step.ps.bytes_sent,
}


class ParameterServerStep(ReplicaStep):
    """The parts of a training step that talk to the servers, with the same
    ``stats`` the summary reads from DataParallel."""

    local_loss = True               # each worker logs its own batches' loss
    finish_changes_weights = True   # finish() pulls the servers' final weights

    def __init__(self, model, optimizer, lr, consistency, staleness, predict=False, compression=None):
        if config.get("PARATRAIN_PS_SCHED_BATCH") and hasattr(os, "SCHED_BATCH"):
            try:
                os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
            except OSError:
                pass   # (not allowed here: the default policy, slower by a wake-up per answer)
        self.model = model
        self.stats = CommStats()
        self.ps = pt.ps.connect()
        _, hyper = optimizer_class(optimizer, lr)   # the servers run the optimizer the workers would
        self.ps.register(model, optimizer=optimizer, consistency=consistency, staleness=staleness,
                         predict=predict, compression=compression, **hyper)
        self.rank, self.world_size = self.ps.worker, self.ps.workers
        self.predict = predict
        self.pulled = False
        self.consistency = consistency

    def coordination(self, settings, start):
        """The workers meet in rank 0's store. Under BSP each takes its own steps in
        lockstep clocks (a shared pool could run dry mid-round and deadlock); under
        ASP and SSP they share the job's batches (coordination.py)."""
        board = StoreBoard.connect(self.rank, self.world_size, timeout_from_env())
        if self.consistency == "bsp":
            return board, Lockstep(settings.steps, start)
        return board, SharedPool(board.store, settings.steps * self.world_size)

    def _timed(self, fn):
        """Run a pull or push; the client's own counters give the time spent waiting
        for servers and the bytes moved, including the embedding rows each forward
        pulls (pt.ps.Embedding), which happen outside these calls."""
        fn()
        self.stats.wait_seconds = self.stats.comm_seconds = self.ps.wait_seconds
        self.stats.bytes = self.ps.bytes_sent + self.ps.bytes_received

    def before_step(self):
        if not self.pulled:   # the first step; afterwards step() has brought the weights
            self._timed(self.ps.pull)
        self.pulled = False
        self.model.zero_grad(set_to_none=False)

    def after_backward(self):
        """Push, clock, and pull the next step's weights, as one request per server on
        this host (Client.step): the reply comes when the consistency model allows."""
        self._timed(self.ps.step)
        self.pulled = True
        self.stats.allreduces += 1

    def logged_loss(self, loss):
        return loss.item()

    def finish(self):
        """The final weights into the model (for the last evaluation and the checkpoint),
        then leave: under SSP a worker that has stopped clocking must not hold back
        those still taking batches from the shared pool (coordination.py)."""
        if not self.pulled or self.predict:   # (the last step() brought them, unless predicted ones)
            self.ps.pull(exact=True)
        self.ps.leave()   # still connected: the final evaluation may read embedding rows

    def state_dict(self):
        return {"optimizer": {}}   # the optimizer's state is on the servers, which checkpoint themselves

    def load_state_dict(self, state):
        raise ValueError(NO_RESUME)

    def staleness_histogram(self):
        """{lag: reads} summed over the servers: how many clocks each read was ahead of
        the slowest worker (each server counts the reads of its own pieces; server.py).
        Asked on a fresh connection, since finish() has closed ours; call it once every
        worker has finished, so the counts are complete."""
        client = pt.ps.connect()
        try:
            total = {}
            for server in range(len(client.addrs)):
                for lag, count in client.stats(server).get("histogram", {}).items():
                    total[int(lag)] = total.get(int(lag), 0) + int(count)
            return dict(sorted(total.items()))
        finally:
            client.close()


def make_step(task, args, settings):
    return ParameterServerStep(task.model, settings.optimizer, settings.lr, args.consistency, args.staleness,
                               args.predict_weights, args.compression)
