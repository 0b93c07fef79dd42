"""``Work``: the handle an ``async_op=True`` call returns, as in torch.distributed.

Each group runs its asynchronous operations on a few single-thread *lanes*
(collectives; sends to each peer; receives from each peer), so operations on
one lane complete in the order they were issued, like a CUDA stream or a
Gloo/NCCL work queue, while a send and a receive, or operations with two
different peers, may be in flight at once (a ring step needs both). Where the
engine has its own nonblocking point to point (torch's isend/irecv, MPI's
Isend), the Work is an EngineWork around the engine's handle instead. A
receive the backend posts at once (shm, mpi) has a Work of its own future
(posted_work): its lane job only keeps the channel read.
"""
import concurrent.futures
import threading
from concurrent.futures import ThreadPoolExecutor   # now, so its exit hook registers before ours

from .errors import CommError

# The program's end, as the lanes' threads can see it. Python joins the threads of
# every ThreadPoolExecutor (our lanes) in a hook of threading's own, which runs
# after the main thread has returned but while it still counts as alive, and
# before atexit, where the groups are destroyed. threading runs its hooks last
# registered first, so this flag is set before that join, and a lane job that
# waits in slices (envelopes.py) can give up instead of holding the exit until its
# timeout. (threading._register_atexit is what concurrent.futures itself uses.)
program_ending = threading.Event()
getattr(threading, "_register_atexit", lambda fn: None)(program_ending.set)


class Work:
    """A pending communication. ``wait()`` blocks until it is done and re-raises its error."""

    def __init__(self, future, what):
        self._future = future
        self.what = what

    def wait(self, timeout=None):
        self.result(timeout)
        return True

    def is_completed(self):
        return self._future.done()

    def exception(self):
        if not self._future.done():
            return None
        try:
            self.result()
        except Exception as e:
            return e
        return None

    def result(self, timeout=None):
        try:
            return self._future.result(timeout=timeout)
        except concurrent.futures.CancelledError:
            raise CommError(f"{self.what} never started: its group was destroyed first "
                            "(pt.destroy() or group.destroy())") from None
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"{self.what} not finished after {timeout}s") from None

    def __repr__(self):
        return f"<Work {self.what} {'done' if self.is_completed() else 'pending'}>"


class EngineWork(Work):
    """A nonblocking operation the engine progresses itself (a torch.distributed
    ``isend``/``irecv`` handle, an MPI request): no lane thread stands behind it,
    so two receives from one peer with different tags may complete in either
    order, as the engine matches them. ``errors(what)`` is a context manager
    turning the engine's error into paratrain's; the buffers in ``keep`` stay
    referenced until it is done.

    Completion is learned by waiting: Gloo's send and receive handles say
    ``is_completed()`` only once somebody has called their ``wait()``. So
    ``wait()`` waits on the caller's thread, while ``is_completed()``,
    ``exception()`` and ``wait(timeout)`` start one watcher thread that waits
    (the engine's own timed wait would abort the operation at its timeout;
    ours leaves it posted, as Work.wait(timeout) leaves its lane running)."""

    LAST_LOOK_SECONDS = 0.5   # how long a wait begun after destroy() gives the engine

    def __init__(self, handle, what, errors, keep=(), destroyed=None):
        self._handle = handle
        self._destroyed = destroyed   # () -> True once the group is destroyed (torch: see _settle)
        self.what = what
        self._errors = errors
        self._keep = keep
        self._error = None
        self._settled = threading.Event()
        self._waiter = None            # the thread that waits on the handle, once one does
        self._lock = threading.Lock()

    def _settle(self):
        try:
            with self._errors(self.what):
                if self._destroyed is not None and self._destroyed():
                    self._last_look()
                else:
                    self._handle.wait()
        except Exception as e:   # kept, and raised by every wait, as a future does
            self._error = e
            if self._destroyed is not None and self._destroyed():
                self._error = self._gone()   # woken by give_up(), or failed as the group went
        self._keep = None
        self._settled.set()

    def _gone(self):
        return CommError(f"{self.what} was still pending when its group was destroyed "
                         "(pt.destroy() or group.destroy())")

    def _last_look(self):
        """A wait begun after the group was destroyed: a Gloo operation, once posted,
        cannot be withdrawn, and an untimed wait would last the whole timeout. So the
        engine gets a moment to say it is done (it may well be, unwaited), and past
        that the operation is given up (torch's timed wait aborts it)."""
        try:
            self._timed_wait()
        except Exception:
            raise self._gone() from None

    def _timed_wait(self):
        import datetime
        self._handle.wait(datetime.timedelta(seconds=self.LAST_LOOK_SECONDS))

    def give_up(self):
        """Called by the group's destroy() (after it is marked destroyed): settle this
        operation now, done or failed, so no thread is left blocked in the engine.
        Nobody waiting: the last look, on this thread. A thread already blocked in
        the engine's untimed wait: Gloo answers a second, timed wait on the same
        handle that runs out by closing the connection to that peer ("Application
        timeout caused pair closure"), which wakes the blocked wait with an error
        (and, had the operation finished meanwhile, both waits return). Left blocked,
        that thread would wait out the timeout and, were the process to exit first,
        abort it ("terminate called without an active exception")."""
        if self._settled.is_set():
            return
        if self._claim(watcher=False):
            self._settle()
            return
        try:
            self._timed_wait()
        except Exception:
            pass
        self._settled.wait(self.LAST_LOOK_SECONDS)

    def _claim(self, watcher):
        """Become the handle's one waiter (this thread, or a new watcher): False if taken."""
        with self._lock:
            if self._waiter is not None:
                return False
            self._waiter = (threading.Thread(target=self._settle, daemon=True, name="paratrain-watch")
                            if watcher else threading.current_thread())
        if watcher:
            self._waiter.start()
        return True

    def wait(self, timeout=None):
        if timeout is None:
            if self._claim(watcher=False):
                self._settle()
            else:
                self._settled.wait()
        else:
            self._claim(watcher=True)
            if not self._settled.wait(timeout):
                raise TimeoutError(f"{self.what} not finished after {timeout}s")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self):
        if not self._settled.is_set() and self._claim(watcher=True):
            # the first look: a few ms for the new watcher to find an operation long done
            self._settled.wait(0.005)
        return self._settled.is_set()

    def exception(self):
        return self._error if self.is_completed() else None

    def result(self, timeout=None):
        self.wait(timeout)


def done_work(what):
    """The Work of an operation already finished on the caller's thread."""
    future = concurrent.futures.Future()
    future.set_result(None)
    return Work(future, what)


def settle(future, error=None):
    """Set a future's outcome unless another thread already did: a posted receive is
    finished by whichever thread delivers its message, or by its own lane on failure."""
    try:
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
    except concurrent.futures.InvalidStateError:
        pass


def posted_work(lanes, lane, future, advance, what):
    """The Work of a receive posted when it was called, as MPI posts an Irecv: done
    when ``future`` is, which whichever thread delivers the message settles. The
    lane job ``advance`` reads messages until this receive is done (so some thread
    always reads while a receive waits, and a sender is never left stuck on a full
    channel); a later receive from the same peer, delivered meanwhile by this
    job, is done at once instead of waiting for its own job's turn. If ``advance``
    fails (the peer died, the deadline passed) or never starts (the group was
    destroyed), that is the receive's result."""
    def on_job_end(job):
        if future.done():
            return
        if job.cancelled():
            settle(future, CommError(f"{what} never finished: its group was destroyed first "
                                     "(pt.destroy() or group.destroy())"))
        elif job.exception() is not None:
            settle(future, job.exception())
    lanes.submit(lane, advance, what)._future.add_done_callback(on_job_end)
    return Work(future, what)


class Lanes:
    """Named single-thread executors, created on first use. A lane submitted to with
    ``reap=True`` is retired once its last job is done (its thread ends; a later
    job makes a new one), for lanes named by something unbounded, such as
    envelopes.py's one per (peer, tag): kept, they would be a thread per tag."""

    def __init__(self, prefix):
        self._prefix = prefix
        self._lanes = {}
        self._last = {}
        self._unfinished = set()   # submitted, not yet done: what shutdown() may wait for
        self._lock = threading.Lock()

    def submit(self, lane, fn, what, reap=False):
        with self._lock:
            ex = self._lanes.get(lane)
            if ex is None:
                ex = ThreadPoolExecutor(1, thread_name_prefix=f"{self._prefix}-{lane}")
                self._lanes[lane] = ex
            fut = ex.submit(fn)
            self._last[lane] = fut
            self._unfinished.add(fut)
        fut.add_done_callback(lambda f: self._finished(f, lane if reap else None))
        return Work(fut, what)

    def _finished(self, fut, reap_lane=None):
        """A job's end. A cancelled one ends inside shutdown(), which holds its
        executor's shutdown lock while it cancels: shutting that executor down
        again from here would wait on the lock forever (and it is going anyway)."""
        with self._lock:
            self._unfinished.discard(fut)
            if reap_lane is not None and not fut.cancelled() and self._last.get(reap_lane) is fut:
                del self._last[reap_lane]
                self._lanes.pop(reap_lane).shutdown(wait=False)   # the thread ends after this callback

    def idle(self, lane):
        """Whether nothing submitted to ``lane`` is still queued or running."""
        with self._lock:
            fut = self._last.get(lane)
        return fut is None or fut.done()

    def drain(self, lane):
        """Wait for everything queued on ``lane``; errors stay with their own Work."""
        fut = self._last.get(lane)
        if fut is not None:
            concurrent.futures.wait([fut])

    def shutdown(self, wait_s=0.0):
        """Cancel what has not started; give what is running up to wait_s seconds to end.
        (A job cancelled here never counts as done for concurrent.futures.wait, so only
        the running ones are waited for; each lane runs at most one.)"""
        with self._lock:   # a snapshot: a reaped lane leaves the dict from a job's thread
            executors = list(self._lanes.values())
        for ex in executors:
            ex.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            running = [f for f in self._unfinished if not f.done()]
        if wait_s > 0 and running:
            concurrent.futures.wait(running, timeout=wait_s)
        with self._lock:
            self._lanes.clear()
            self._last.clear()
