"""Synchronous data parallelism: every worker holds the whole model, trains on its
own slice of each batch, and gradients are averaged so every replica takes the
same step.

Two versions side by side, as picotron keeps them:

- ``DataParallelNaive``: after backward, all-reduce each gradient, one at a time.
  Simple and correct; pays the latency of one collective per parameter and
  leaves the network idle while backward runs.
- ``DataParallel``: gradients live in buckets (buckets.py), and each bucket is
  all-reduced on a communication thread the moment its last gradient is
  accumulated, while backward computes the rest (Li et al., "PyTorch
  Distributed", VLDB 2020, arXiv 2006.15704, sections 3.2.3 and 4.2); or, where
  that cannot pay (``overlap_pays``: the shm engine with no spare core), all
  buckets right after backward on the training thread. Backward returns only
  once every bucket is averaged, so ``loss.backward()`` followed by
  ``opt.step()`` just works.

Both broadcast rank 0's parameters and buffers at construction, check that all
ranks built the same model, and offer ``no_sync()`` (accumulate gradients
locally; the next synchronised backward averages the sum) and ``join()``
(uneven inputs: join.py).

Parameters that get no gradient in a step need no flag (DDP's
``find_unused_parameters``): at the end of backward, any parameter whose hook
did not fire is treated as ready with a zero gradient (or the gradient it
accumulated under no_sync), so every rank makes the same collectives and no
rank hangs. The price is that such a parameter's bucket is only sent at the
end of backward; after the step the parameter's ``.grad`` holds the average
of the other ranks' gradients (zeros if no rank used it, where a
single-process run would leave ``.grad`` as None).
"""
import concurrent.futures
import contextlib
import os
import time
import zlib
from dataclasses import dataclass

import torch
import torch.utils._pytree
from torch import nn

from ..trace import recorder as trace
from . import buckets as bucketing
from . import join as joining
from .comm_hooks import make_hook
from . import linear_grads


@dataclass
class CommStats:
    """What the gradient averaging cost, since construction (or the last reset)."""
    bytes: int = 0            # bytes this rank put into all-reduces
    allreduces: int = 0       # collective calls made for gradients
    comm_seconds: float = 0.0  # time the communication itself took
    wait_seconds: float = 0.0  # time backward waited for it after its own work (not hidden by overlap)

    def reset(self):
        self.bytes, self.allreduces, self.comm_seconds, self.wait_seconds = 0, 0, 0.0, 0.0

    def blocked(self, seconds):
        """Communication the caller waited through with nothing beside it: all of its time
        is waiting (which the trainer takes out of a step's compute)."""
        self.comm_seconds += seconds
        self.wait_seconds += seconds


def overlap_pays(group):
    """Does reducing buckets on a second thread during backward make a step shorter?

    Only if the communication does not need the core that backward is using.
    Over Gloo (or across hosts) a reduction mostly waits on sockets, and a
    waiting thread costs nothing: overlap, as DDP does. The shm engine's
    all-reduce is memory work done by the CPU itself; with one worker per core
    (the launcher's default on a small machine) it can only time-share the core
    with backward, adding thread switches and cache misses. So on shm we
    overlap only when every worker has a spare core for its communication
    thread; ``overlap=True`` forces it (``paratrain bench data-parallel`` shows
    both).
    """
    if group.backend != "shm":
        return True
    local = int(os.environ.get("LOCAL_WORLD_SIZE", group.world_size))
    return (os.cpu_count() or 1) >= local * (torch.get_num_threads() + 1)


def _engine_callback(fn):
    """Run fn when the current backward pass has finished (DDP uses the same hook:
    arXiv 2006.15704 section 4.2, 'queue_callback' at the end of backward)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


class _DataParallelBase(nn.Module):
    def __init__(self, module, group=None, broadcast_buffers=True):
        super().__init__()
        from ..comm import world
        self.module = module
        self.group = group or world()
        self.broadcast_buffers = broadcast_buffers
        self.stats = CommStats()
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._require_sync = True
        self._joining = None
        self._backward_began = None   # (time, CPU time) backward reached the output, when traced
        self._check_same_model()
        self.sync_module_states()

    traces_its_passes = True   # records forward and backward itself, when the run is traced

    def forward(self, *args, **kwargs):
        if self._joining is not None:
            self._joining.on_forward(self)
        elif self.broadcast_buffers and self.training:
            self._broadcast_buffers()
        if not trace.ON:
            return self.module(*args, **kwargs)
        t0, c0 = time.perf_counter(), trace.cpu_now()
        out = self.module(*args, **kwargs)
        trace.add_compute("forward", t0, c0)
        self._backward_began = None
        first = next((t for t in torch.utils._pytree.tree_leaves(out)
                      if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if first is not None:   # backward reaches the output's gradient first: its start
            first.register_hook(self._note_backward_start)
        return out

    def _note_backward_start(self, grad):
        if self._backward_began is None:
            self._backward_began = (time.perf_counter(), trace.cpu_now())

    def _note_backward_end(self):
        """Called first thing at the end of backward: its span, when traced."""
        began, self._backward_began = self._backward_began, None
        if trace.ON and began is not None:
            trace.add_compute("backward", *began)

    # ---- replicas start (and stay) the same ---------------------------------------

    def _check_same_model(self):
        """All ranks must hold the same parameter shapes, or their gradients would be
        averaged element by element into nonsense: compare a signature of the shapes."""
        shapes = ";".join(f"{tuple(p.shape)}:{p.dtype}" for p in self._params)
        sig = torch.tensor([len(self._params), sum(p.numel() for p in self._params),
                            zlib.crc32(shapes.encode())], dtype=torch.int64)
        every = torch.zeros(self.group.world_size * 3, dtype=torch.int64)
        self.group.all_gather(every, sig)
        every = every.view(-1, 3)
        bad = [r for r in range(self.group.world_size) if not torch.equal(every[r], every[0])]
        if bad:
            rows = "\n".join(f"  rank {r}: {int(every[r, 0])} parameters, {int(every[r, 1])} elements"
                             for r in range(self.group.world_size))
            raise ValueError(f"{type(self).__name__}: ranks {bad} built a different model from rank 0 "
                             f"(parameter shapes or dtypes differ):\n{rows}\n"
                             "every rank must construct the same model with the same arguments")

    @torch.no_grad()
    def regroup(self, group):
        """Go on over ``group``: the new world pt.elastic formed after a peer died or
        joined. The module and its hooks stay; the collectives of construction run
        again, in the same order (a worker that joins is constructing its own), and
        what lived in the old group's memory is made again in the new one's."""
        self.group = group
        self._joining = None
        self._check_same_model()
        self.sync_module_states()

    def sync_module_states(self, src=0):
        """Copy rank ``src``'s parameters and buffers to every rank."""
        for t in list(self.module.parameters()) + list(self.module.buffers()):
            self._broadcast(t.data, src)

    @torch.no_grad()
    def _broadcast_buffers(self):
        for b in self.module.buffers():
            self._broadcast(b, 0)

    def _broadcast(self, t, src):
        if t.is_contiguous():
            self.group.broadcast(t, src)
        else:
            tmp = t.contiguous()
            self.group.broadcast(tmp, src)
            t.copy_(tmp)

    # ---- user-facing switches ---------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self):
        """Inside, backward only accumulates local gradients; the first backward after
        it averages everything accumulated (gradient accumulation without traffic)."""
        old, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = old

    def join(self, enable=True):
        """Context manager for uneven inputs (join.py): a rank that runs out of
        batches keeps answering the others' collectives until all are done."""
        return joining.Join(self, enable)

    # ---- what a backward pass communicates (subclasses) -----------------------------------

    def _shadow_backward(self):
        """On a rank that has joined: make exactly the collectives one synchronised
        backward makes, contributing zero gradients."""
        raise NotImplementedError


class DataParallelNaive(_DataParallelBase):
    """After backward, all-reduce every gradient, one parameter at a time, blocking.

    cost per step = (number of parameters) x (all-reduce latency) + total bytes x beta,
    none of it overlapped with backward. The baseline DataParallel is measured against.
    """

    def __init__(self, module, group=None, broadcast_buffers=True, algorithm=None):
        super().__init__(module, group, broadcast_buffers)
        self.algorithm = algorithm
        self._queued = False
        for p in self._params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, p):
        if self._require_sync and not self._queued:
            self._queued = True
            _engine_callback(self._after_backward)

    def _after_backward(self):
        self._note_backward_end()
        self._queued = False
        self._average_all()

    def _average_all(self):
        t0 = time.perf_counter()
        for p in self._params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self.group.all_reduce(p.grad, op="avg", algorithm=self.algorithm)
            self.stats.bytes += p.grad.numel() * p.grad.element_size()
            self.stats.allreduces += 1
        self.stats.blocked(time.perf_counter() - t0)

    def _shadow_backward(self):
        for p in self._params:
            if p.grad is not None:
                p.grad.zero_()
        self._average_all()


class DataParallel(_DataParallelBase):
    """Bucketed, overlapped gradient averaging (what users of PyTorch DDP expect).

    bucket_mb: bucket size in MB (DDP's default 25); the first bucket is at most 1 MB.
    compression: None, "fp16", "bf16", or a hook object (comm_hooks.py).
    algorithm: the all-reduce algorithm (None: the backend's choice; "ring", "naive", ...).
    overlap: reduce buckets on a communication thread during backward (True), or
    all of them on the training thread when backward ends (False). None decides
    by where the work of communicating happens (``overlap_pays``).
    linear_grads_in_buckets: linear layers' weight and bias gradients computed
    straight into the buckets, with no copy (linear_grads.py); None: wherever
    the buckets are averaged after backward (overlap off). Only there: a
    weight used twice in one forward gets its gradient in two parts, which
    is harmless when nothing is sent before backward ends, but with overlap
    the first part would mark its bucket ready.
    """

    def __init__(self, module, group=None, bucket_mb=25.0, broadcast_buffers=True, compression=None,
                 algorithm=None, overlap=None, linear_grads_in_buckets=None):
        super().__init__(module, group, broadcast_buffers)
        self.overlap = overlap_pays(self.group) if overlap is None else bool(overlap)
        if linear_grads_in_buckets and self.overlap:
            raise ValueError("linear_grads_in_buckets needs overlap off: with overlap, a bucket is sent as soon "
                             "as autograd says its gradients are complete (linear_grads.py)")
        self.linear_grads_in_buckets = not self.overlap if linear_grads_in_buckets is None \
            else bool(linear_grads_in_buckets)
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
        self.hook = make_hook(compression, algorithm)
        self._bucket_bytes = int(bucket_mb * 1e6)
        self._make_buckets()
        for p in self._where:
            p.register_post_accumulate_grad_hook(self._on_grad)
        # the plain nn.Linear layers whose parameters all live in buckets, and large enough
        # that the copy saved outweighs a Python call (linear_grads.py: LINEAR_GRADS_MIN_NUMEL)
        self._linears = [m for m in module.modules() if type(m) is nn.Linear
                         and m.weight.numel() >= linear_grads.LINEAR_GRADS_MIN_NUMEL
                         and all(q in self._where for q in m.parameters())]
        self._comm = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="paratrain-dp")
        self._reset_backward()

    def _make_buckets(self):
        """The buckets in this group's memory, and the hook told of them (collective)."""
        self.buckets = bucketing.build(self.group, self._params, self._bucket_bytes)
        if getattr(self.hook, "wants_shapes", False):   # a compressor of matrices (compression/base.py)
            self.hook.prepare(self.group, [b.flat for b in self.buckets],
                              shapes=[[tuple(v.shape) for v in b.views] for b in self.buckets])
        else:
            self.hook.prepare(self.group, [b.flat for b in self.buckets])
        self._where = {p: (b, i) for b in self.buckets for i, p in enumerate(b.params)}

    def regroup(self, group):
        super().regroup(group)
        self._make_buckets()
        self._reset_backward()

    def elastic_commits(self):
        """pt.elastic.State's commits of what differs between ranks here: a compressor's
        residuals (compression/elastic.py), each with a copy on the next rank; None
        without a compressor that keeps state."""
        if not getattr(self.hook, "STATE", ()):
            return None
        if getattr(self, "_elastic_commits", None) is None:
            from .compression.elastic import Commits
            self._elastic_commits = Commits(self.hook, lambda: self.group)
        return self._elastic_commits

    def _reset_backward(self):
        self._fired = set()
        self._ready = [False] * len(self.buckets)
        self._next = 0
        self._futures = []
        self._queued = False

    def forward(self, *args, **kwargs):
        if not (self.linear_grads_in_buckets and self.training and torch.is_grad_enabled()):
            return super().forward(*args, **kwargs)
        with linear_grads.LinearsWithOwnGrads(self._linears, self._put_grad):
            return super().forward(*args, **kwargs)

    # ---- during backward ---------------------------------------------------------------

    def _put_grad(self, p, product):
        """A linear layer's gradient for p (linear_grads.py): computed into its bucket view
        when p has none yet, else added to what it holds, as autograd accumulates."""
        b, i = self._where[p]
        if p.grad is None:
            product.into(b.views[i])
            p.grad = b.views[i]
        else:
            p.grad.add_(product.fresh())
        self._on_grad(p)

    def _on_grad(self, p):
        """Autograd has accumulated p's gradient (post-accumulate-grad hook)."""
        b, i = self._where[p]
        b.adopt_grad(i)
        if not self._require_sync:
            return
        if not self._queued:
            self._queued = True
            _engine_callback(self._after_backward)
        if p in self._fired:
            return
        self._fired.add(p)
        b.pending -= 1
        if b.pending == 0 and self.overlap:
            self._ready[b.index] = True
            self._launch_ready()

    def _launch_ready(self):
        """Launch ready buckets strictly in bucket order, so that every rank issues
        the same collectives in the same order whatever order its gradients came in."""
        while self._next < len(self.buckets) and self._ready[self._next]:
            self._futures.append(self._comm.submit(self._reduce_bucket, self.buckets[self._next]))
            self._next += 1

    def _reduce_bucket(self, b):
        t0 = time.perf_counter()
        with trace.label(f"bucket {b.index}"):
            self.hook(self.group, b.index, b.flat)
        self.stats.comm_seconds += time.perf_counter() - t0
        self.stats.bytes += self.hook.wire_bytes(b.flat)
        self.stats.allreduces += 1

    def _after_backward(self):
        """End of backward: parameters that got no gradient count as ready (with what
        their bucket slot holds), the rest of the buckets go, and we wait for all."""
        self._note_backward_end()
        try:
            for b in self.buckets:
                for i, p in enumerate(b.params):
                    if p not in self._fired:
                        b.adopt_grad(i)
                self._ready[b.index] = True
                b.pending = len(b.params)
            t0 = time.perf_counter()
            if self.overlap:
                self._launch_ready()
                for f in self._futures:
                    f.result()
            else:
                for b in self.buckets:
                    self._reduce_bucket(b)
            self.stats.wait_seconds += time.perf_counter() - t0
        finally:
            self._reset_backward()

    def _shadow_backward(self):
        for b in self.buckets:
            b.flat.zero_()
            for i in range(len(b.params)):
                b.adopt_grad(i)
        self._ready = [True] * len(self.buckets)
        self._after_backward()

    # ---- conveniences ----------------------------------------------------------------------

    def zero_grad(self, set_to_none=True):
        """As ``nn.Module.zero_grad``: by default gradients become None, and the next
        backward's fresh gradients are copied into the buckets as they are accumulated
        (``Bucket.adopt_grad``). ``set_to_none=False`` zeroes every bucket in one pass
        and keeps the gradients as bucket views, so backward adds into them.

        The copy is the cheaper of the two: it reads and writes each gradient once,
        where zeroing writes it and accumulating reads two and writes one. It holds
        only while freed memory is kept for reuse (launch/heap.py); otherwise each
        step's fresh gradients are new mmaps, faulted in page by page."""
        if set_to_none:
            return super().zero_grad(set_to_none=True)
        for b in self.buckets:
            b.flat.zero_()
            for i in range(len(b.params)):
                b.adopt_grad(i)
