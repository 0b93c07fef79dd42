"""A worker's peak memory for the summary: how far the bytes it allocated grew above where it began.

Two measures, both above what the worker held before it built the task
(workers are forked from a process that has torch loaded: hundreds of MB
the same for every strategy):

- ``peak_memory_mb``: the heap, malloc's bytes in use (glibc's mallinfo2:
  small chunks plus the large ones it maps), and its peak kept. This is what
  the worker's tensors, buffers and the runtime's scratch hold, the CPU's
  counterpart of torch.cuda.max_memory_allocated, and what ``paratrain
  plan`` predicts. Its peak is brief (activations are freed as backward
  runs), so it is not read at step ends but where it happens: at the end of
  every module's forward (a global forward hook: the last one of a step
  sees every activation alive; an evaluation's are seen too), and where the
  trainer calls ``sample()`` (after backward, with every gradient, and after
  the optimizer's step, with its state). A thread sampling every millisecond
  sees the same peak, but its wake-ups, each taking the GIL from the compute,
  cost about a tenth of a gpt step on 2 busy cores (0-13% in A/B rounds);
  the hook, 45 calls of 5 us a gpt step, costs nothing measurable.
- ``peak_rss_mb``: the resident set's peak (getrusage's maxrss), which also
  counts freed memory malloc kept, code pages first touched, and the shared
  memory the engine maps; what a memory limit sees, and noisier.

Without mallinfo2 (not glibc, or older than 2.33) the heap is not measured
and ``peak_memory_mb`` is the resident one.
"""
import ctypes
import ctypes.util
import os
import resource

PAGE_MB = os.sysconf("SC_PAGE_SIZE") / (1 << 20)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo2():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        f = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    f.restype, f.argtypes = _MallInfo2, []
    return f


_MALLINFO2 = _mallinfo2()


def heap_mb():
    """MiB malloc has handed out and not had back (in use), or None where it cannot say."""
    if _MALLINFO2 is None:
        return None
    m = _MALLINFO2()
    return (m.uordblks + m.hblkhd) / (1 << 20)


def resident_mb():
    """This process's resident set now, in MiB (/proc/self/statm's second field)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE_MB
    except (OSError, ValueError, IndexError):
        return 0.0


def peak_resident_mb(before):
    """MiB this process's resident set peaked at above ``before`` (Linux reports maxrss in KiB)."""
    return max(0.0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before)


class PeakMemory:
    """Started before the task is built; ``report()`` gives the two peaks above that moment."""

    def __init__(self):
        self.resident_before = resident_mb()
        self.heap_before = heap_mb()
        self.heap_peak = self.heap_before
        self._hook = None
        if self.heap_before is not None:
            import torch
            self._hook = torch.nn.modules.module.register_module_forward_hook(lambda *_: self.sample())

    def sample(self):
        """Note the heap now (a moment it may peak at)."""
        if self.heap_before is not None:
            self.heap_peak = max(self.heap_peak, heap_mb())

    def added_by(self, call):
        """MiB the heap peaked above its level at the start of ``call()`` while it ran; the
        peak ``report`` gives stays the whole run's. None where the heap cannot be read."""
        if self.heap_before is None:
            call()
            return None
        earlier, before = self.heap_peak, heap_mb()
        self.heap_peak = before
        call()
        self.sample()
        added = self.heap_peak - before
        self.heap_peak = max(self.heap_peak, earlier)
        return added

    def report(self):
        """{"peak_memory_mb", "peak_rss_mb"}; stops the sampling."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        rss = peak_resident_mb(self.resident_before)
        heap = None if self.heap_before is None else max(0.0, max(self.heap_peak, heap_mb()) - self.heap_before)
        return {"peak_memory_mb": rss if heap is None else heap, "peak_rss_mb": rss}
