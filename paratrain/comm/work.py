"""``Work``: the handle an ``async_op=True`` call returns, as in torch.distributed.

Each group runs its asynchronous operations on a few single-thread *lanes*
(collectives; sends to each peer; receives from each peer), so operations on
one lane complete in the order they were issued, like a CUDA stream or a
Gloo/NCCL work queue, while a send and a receive, or operations with two
different peers, may be in flight at once (a ring step needs both).
"""
import concurrent.futures
import threading
import time


class Work:
    """A pending communication. ``wait()`` blocks until it is done and re-raises its error."""

    def __init__(self, future, what):
        self._future = future
        self.what = what

    def wait(self, timeout=None):
        try:
            self._future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"{self.what} not finished after {timeout}s") from None
        return True

    def is_completed(self):
        return self._future.done()

    def exception(self):
        return self._future.exception() if self._future.done() else None

    def result(self):
        return self._future.result()

    def __repr__(self):
        return f"<Work {self.what} {'done' if self.is_completed() else 'pending'}>"


class EngineWork(Work):
    """A nonblocking operation the engine progresses itself (a torch.distributed
    ``isend``/``irecv`` handle): no lane thread stands behind it, so two receives
    from one peer with different tags may complete in either order, as the engine
    matches them. ``errors(what)`` is a context manager turning the engine's error
    into paratrain's; the buffers in ``keep`` stay referenced until it is done."""

    def __init__(self, handle, what, errors, keep=()):
        self._handle = handle
        self.what = what
        self._errors = errors
        self._keep = keep
        self._error = None
        self._done = False
        self._lock = threading.Lock()

    def wait(self, timeout=None):
        if timeout is not None:
            self._poll(time.monotonic() + timeout, timeout)
        self._finish()
        return True

    def _poll(self, deadline, timeout):
        """Wait for completion until the deadline without cancelling anything, as
        Work.wait(timeout) leaves its lane running (the engine's own wait would
        abort the operation at its timeout)."""
        delay = 1e-4
        while not self._handle.is_completed():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.what} not finished after {timeout}s")
            time.sleep(min(delay, left))
            delay = min(2 * delay, 0.01)

    def _finish(self):
        with self._lock:
            if not self._done:
                try:
                    with self._errors(self.what):
                        self._handle.wait()
                except Exception as e:   # kept, and raised by every wait, as a future does
                    self._error = e
                self._done = True
                self._keep = None
        if self._error is not None:
            raise self._error

    def is_completed(self):
        return self._done or self._handle.is_completed()

    def exception(self):
        if not self.is_completed():
            return None
        try:
            self._finish()
        except Exception as e:
            return e
        return None

    def result(self):
        self._finish()


class Lanes:
    """Named single-thread executors, created on first use."""

    def __init__(self, prefix):
        self._prefix = prefix
        self._lanes = {}
        self._last = {}
        self._lock = threading.Lock()

    def submit(self, lane, fn, what):
        with self._lock:
            ex = self._lanes.get(lane)
            if ex is None:
                ex = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"{self._prefix}-{lane}")
                self._lanes[lane] = ex
            fut = ex.submit(fn)
            self._last[lane] = fut
        return Work(fut, what)

    def drain(self, lane):
        """Wait for everything queued on ``lane``; errors stay with their own Work."""
        fut = self._last.get(lane)
        if fut is not None:
            concurrent.futures.wait([fut])

    def shutdown(self):
        for ex in self._lanes.values():
            ex.shutdown(wait=False, cancel_futures=True)
        self._lanes.clear()
