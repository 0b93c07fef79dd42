"""A worker's peak memory for the summary: how far the bytes it allocated grew above where it began.

Two measures, both above what the worker held before it built the task
(workers are forked from a process that has torch loaded: hundreds of MB
the same for every strategy):

- ``peak_memory_mb``: the heap, malloc's bytes in use (glibc's mallinfo2:
  small chunks plus the large ones it maps), sampled every millisecond by a
  thread, and its peak kept. This is what the worker's tensors, buffers and
  the runtime's scratch hold, the CPU's counterpart of
  torch.cuda.max_memory_allocated, and what ``paratrain plan`` predicts. Its
  peak is brief (activations are freed as backward runs), so it is sampled,
  not read at step ends.
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
import threading

PAGE_MB = os.sysconf("SC_PAGE_SIZE") / (1 << 20)
SAMPLE_S = 0.001


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

    def __init__(self, every_s=SAMPLE_S):
        self.resident_before = resident_mb()
        self.heap_before = heap_mb()
        self.heap_peak = self.heap_before
        self._stop = threading.Event()
        self._thread = None
        if self.heap_before is not None:
            self._thread = threading.Thread(target=self._sample, args=(every_s,), name="paratrain-heap-peak",
                                            daemon=True)
            self._thread.start()

    def _sample(self, every_s):
        while not self._stop.wait(every_s):
            self.heap_peak = max(self.heap_peak, heap_mb())

    def report(self):
        """{"peak_memory_mb", "peak_rss_mb"}; stops the sampling."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1)
        rss = peak_resident_mb(self.resident_before)
        heap = None if self.heap_before is None else max(0.0, max(self.heap_peak, heap_mb()) - self.heap_before)
        return {"peak_memory_mb": rss if heap is None else heap, "peak_rss_mb": rss}
