"""Rank 0's progress, drawn by the process that owns the terminal.

Workers never see a terminal: the launcher reads their stdout through a pipe
(launch/worker.py). So rank 0 does not draw a bar; its ProgressReporter prints
one machine-readable line now and then,

    PROGRESS_MARK + {"step": 120, "total": 600, "loss": 0.531, "samples_per_s": 1234.0}

and the front-end hands ProgressDisplay.on_line to the launcher, which offers
it every worker line first: marked lines are consumed and turned into a
``rich`` bar (on a terminal) or a short status line every few seconds (in a
CI log or a pipe, where a redrawn bar would be thousands of lines of noise).
Every other line is relayed as usual.

The lines are JSON, never pickle: the launcher only reads data from them. The
mark starts with ASCII RS (0x1E, "record separator"), which no ordinary
output begins with. It must start a line: a worker that left a line unfinished
(``print(..., end="")``) before a progress update hides that update.
Beware that Python's ``str.splitlines()`` counts RS as a line break; the
launcher splits worker output on b"\n" only, so the mark arrives whole, but a
tool reading such output with splitlines() would see it cut in two.
"""
import io
import json
import math
import sys
import threading
import time

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
from rich.text import Text

from ..launch.worker import OUTPUT_LOCK

PROGRESS_MARK = "\x1eparatrain-progress "
PLAIN_INTERVAL = 5.0  # seconds between status lines when the output is not a terminal
EXIT_LOCK_TIMEOUT = 5.0  # seconds __exit__ waits for a reader thread stuck writing


# -- worker side --------------------------------------------------------------

class ProgressReporter:
    """Prints rank 0's progress lines for the front-end; on other ranks, nothing.

    At most one line per min_interval seconds (a step can take a millisecond,
    and every line crosses a pipe and a lock), but always the last step, so the
    bar ends full."""

    def __init__(self, total_steps, enabled, min_interval=0.5, clock=time.monotonic, file=None):
        self.total = int(total_steps)
        self.enabled = bool(enabled)
        self.min_interval = min_interval
        self._clock = clock
        self._file = file  # None: sys.stdout at the time of each update
        self._last = None

    def update(self, step, **fields):
        """Report that step steps (of total_steps) are done; fields such as
        loss=..., samples_per_s=... go along (numbers, strings; tensors with .item())."""
        if not self.enabled:
            return
        now = self._clock()
        final = step >= self.total
        if not final and self._last is not None and now - self._last < self.min_interval:
            return
        self._last = now
        msg = {k: _scalar(v) for k, v in fields.items()}
        msg.update(step=int(step), total=self.total)
        out = self._file or sys.stdout
        # default=str: an odd field must not stop the training; NaN goes as NaN
        # (Python's json reads it back, and a diverged loss should show as nan).
        out.write(PROGRESS_MARK + json.dumps(msg, default=str) + "\n")
        out.flush()


def _scalar(v):
    item = getattr(v, "item", None)
    if callable(item) and not isinstance(v, (int, float, str)):
        try:
            return item()
        except (ValueError, RuntimeError):
            return str(v)
    return v


# -- launcher side ------------------------------------------------------------

def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def parse_progress(text):
    """The message in a progress line, or None when text is not one (or is damaged)."""
    if not text.startswith(PROGRESS_MARK):
        return None
    try:
        msg = json.loads(text[len(PROGRESS_MARK):])
    except ValueError:
        return None
    if not isinstance(msg, dict):
        return None
    step, total = msg.get("step"), msg.get("total")
    if not (_is_number(step) and _is_number(total) and math.isfinite(step) and math.isfinite(total)):
        return None
    if step < 0 or total < 1:
        return None
    msg["step"], msg["total"] = int(step), int(total)
    return msg


def format_clock(seconds):
    """'0:12', '12:05', '1:02:03'."""
    s = int(max(0.0, seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _fmt_loss(v):
    return f"{v:.4g}" if _is_number(v) else "-"


def _fmt_rate(v):
    return f"{v:,.0f} samples/s" if _is_number(v) and math.isfinite(v) else ""


class _AboveBar(io.TextIOBase):
    """What sys.stdout (and a terminal sys.stderr) is while the bar is live:
    whole lines go to the console, which prints them above the bar.

    Why not rich's own redirection, ``Progress(redirect_stdout=True)``? Its
    FileProxy forwards every attribute it lacks to the real stream, ``.buffer``
    included, and the launcher's emit() writes bytes to ``.buffer`` whenever
    there is one: worker lines then bypassed rich and landed on the terminal
    glued to the bar. This class has no ``.buffer``, so emit() falls back to
    ``.write(str)``, which arrives here."""

    def __init__(self, console, original):
        super().__init__()
        self._console = console
        self._original = original
        self._pending = ""
        self._lock = threading.Lock()

    @property
    def encoding(self):
        return getattr(self._original, "encoding", "utf-8")

    def writable(self):
        return True

    def isatty(self):
        return self._original.isatty()

    def fileno(self):
        return self._original.fileno()

    def write(self, text):
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        with self._lock:  # also keeps two writers' lines in order
            self._pending += text
            if "\n" in self._pending:
                *lines, self._pending = self._pending.split("\n")
                self._print(lines)
        return len(text)

    def flush(self):
        pass  # an unfinished line waits for its end (or for finish())

    def finish(self):
        with self._lock:
            if self._pending:
                self._print([self._pending])
                self._pending = ""

    def _print(self, lines):
        # Text, not str: "[rank 0]" must not be read as rich markup; from_ansi
        # keeps a worker's own colours.
        out = Text("\n").join(Text.from_ansi(line.rstrip("\r")) for line in lines)
        self._console.print(out, soft_wrap=True)


class ProgressDisplay:
    """The front-end's view of rank 0's progress; a context manager.

        with ProgressDisplay("mlp x2") as display:
            rc = launch(argv, on_line=display.on_line)

    On an interactive terminal: a rich bar (description, bar, step/total, loss,
    samples/s, elapsed, ETA), with all other output printed above it. Otherwise
    one plain status line at most every `interval` seconds, and one at the end.
    """

    def __init__(self, title, console=None, interval=PLAIN_INTERVAL, clock=time.monotonic):
        self.title = title
        self.console = console
        self.interval = interval
        self._clock = clock
        self.last = None          # the last progress message received
        self.live = False
        self._progress = None
        self._task = None
        self._t0 = clock()        # elapsed counts from here (includes the workers' start-up)
        self._first = None        # (step, time) of the first message: the ETA's baseline
        self._last_print = None   # when the last plain status line was printed
        self._unprinted = False   # plain mode: a message arrived since the last status line
        self._saved_streams = None

    # -- context manager

    def __enter__(self):
        if self.console is None:
            self.console = Console(file=sys.stdout)  # pinned: sys.stdout is about to be replaced
        self._t0 = self._clock()
        self.live = self.console.is_interactive
        if self.live:
            self._progress = Progress(
                TextColumn("{task.description}", style="bold", markup=False), BarColumn(),
                MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}", markup=False),
                TextColumn("{task.fields[rate]}", markup=False), TimeElapsedColumn(),
                TextColumn("ETA"), TimeRemainingColumn(),
                console=self.console, redirect_stdout=False, redirect_stderr=False)
            self._task = self._progress.add_task(self.title, total=None, loss="-", rate="")
            self._progress.start()
            self._saved_streams = (sys.stdout, sys.stderr)
            sys.stdout = _AboveBar(self.console, sys.stdout)
            if _isatty(sys.stderr):  # a stderr sent to a file stays there
                sys.stderr = _AboveBar(self.console, sys.stderr)
        return self

    def __exit__(self, *exc):
        # Reader threads write under OUTPUT_LOCK; take it so none is halfway
        # through a line while the streams are swapped back. Bounded: a reader
        # stuck on a blocked terminal must not hang the exit.
        locked = OUTPUT_LOCK.acquire(timeout=EXIT_LOCK_TIMEOUT)
        try:
            if self.live:
                if self._saved_streams is not None:
                    for stream in (sys.stdout, sys.stderr):
                        if isinstance(stream, _AboveBar):
                            stream.finish()
                    sys.stdout, sys.stderr = self._saved_streams
                    self._saved_streams = None
                self._progress.stop()
            elif self._unprinted:
                self._print_status()
        finally:
            if locked:
                OUTPUT_LOCK.release()

    # -- the launcher hook

    def on_line(self, worker, stream_name, text):
        """The launcher's hook: True (consumed) for a progress line; False for
        anything else, including a damaged progress line, which is then printed
        as it is. Called by the reader threads holding OUTPUT_LOCK."""
        if not text.startswith(PROGRESS_MARK):
            return False
        msg = parse_progress(text)
        if msg is None:
            return False
        self._show(msg)
        return True

    def _show(self, msg):
        now = self._clock()
        if self._first is None:
            self._first = (msg["step"], now)
        self.last = msg
        if self.live:
            self._progress.update(self._task, total=msg["total"], completed=min(msg["step"], msg["total"]),
                                  loss=_fmt_loss(msg.get("loss")), rate=_fmt_rate(msg.get("samples_per_s")))
            return
        if self.console is None:
            self.console = Console()
        self._unprinted = True
        if self._last_print is None or now - self._last_print >= self.interval or msg["step"] >= msg["total"]:
            self._print_status(now)

    # -- plain mode

    def status(self, now=None):
        """'step 120/600 (20%) loss 0.531 1,234 samples/s elapsed 0:12 ETA 0:48' for the last message."""
        msg = self.last
        now = self._clock() if now is None else now
        step, total = msg["step"], msg["total"]
        parts = [f"step {step}/{total} ({100 * step / total:.0f}%)"]
        if _is_number(msg.get("loss")):
            parts.append(f"loss {_fmt_loss(msg['loss'])}")
        rate = _fmt_rate(msg.get("samples_per_s"))
        if rate:
            parts.append(rate)
        parts.append(f"elapsed {format_clock(now - self._t0)}")
        s0, t0 = self._first
        if step >= total:
            pass
        elif step > s0 and now > t0:
            parts.append(f"ETA {format_clock((total - step) * (now - t0) / (step - s0))}")
        else:
            parts.append("ETA ?")
        return " ".join(parts)

    def _print_status(self, now=None):
        if self.last is None:
            return
        now = self._clock() if now is None else now
        self.console.print(Text(f"{self.title}: {self.status(now)}"), soft_wrap=True)
        self._last_print = now
        self._unprinted = False


def _isatty(stream):
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False
