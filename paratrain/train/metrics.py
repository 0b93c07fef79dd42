"""A run's numbers: one JSON line per step, a plot of loss against time, a summary table.

The per-step log is JSON Lines (``runs/<id>/metrics.jsonl``), written one line
and one flush at a time. Appending a line is the only thing that ever happens to
the file, so a worker killed at any moment leaves every finished step readable
and at most its last line cut short; ``read_metrics`` skips that line with a
warning. JSON rather than a binary format, so ``jq``, pandas or a text editor
can read a run without paratrain. The values are plain JSON: a NaN or infinite
loss (a diverged run) is written as ``null``, because the JSON standard
(RFC 8259 section 6) has no such numbers and strict readers reject them.

The plot is drawn on a ``matplotlib.figure.Figure`` with the Agg canvas, never
through pyplot: no GUI backend, no global figure list, nothing to close, and
safe on a machine without a display.
"""
import json
import math
import os
import warnings

from rich.console import Console

from .elastic_events import describe as describe_event
from rich.table import Table

METRICS_FILE = "metrics.jsonl"


def jsonable(value, where="value"):
    """value as plain JSON data: torch / numpy scalars become Python numbers,
    NaN and infinities become None, lists and dicts are converted inside.

    Tensors and arrays are recognised by their ``.item()`` (duck typing), so this
    module does not import torch and the front-end process stays light. Anything
    else (a multi-element tensor, an object) is a TypeError naming the field."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, (list, tuple)):
        return [jsonable(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {str(k): jsonable(v, f"{where}.{k}") for k, v in value.items()}
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return jsonable(item(), where)
        except (ValueError, RuntimeError):  # numpy / torch: "only one element tensors can be converted"
            pass
    raise TypeError(f"{where}: cannot log a {type(value).__name__} as a metric; log a number or a string "
                    "(for a one-element tensor, .item())")


class MetricsLog:
    """Appends one JSON object per line to ``run_dir/metrics.jsonl``.

        with MetricsLog(run_dir) as log:
            log.log(step=1, time=0.12, loss=2.31)
    """

    def __init__(self, run_dir, name=METRICS_FILE):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, name)
        _drop_unfinished_line(self.path)
        # Line-buffered text: each line reaches the OS as soon as it is complete.
        self._file = open(self.path, "a", encoding="utf-8", buffering=1)

    def log(self, **fields):
        row = {k: jsonable(v, k) for k, v in fields.items()}
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()

    def close(self):
        if not self._file.closed:
            self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _drop_unfinished_line(path):
    """Cut a line a crash left unfinished at the end of an existing log, so the
    next append starts on a line of its own instead of gluing onto garbage."""
    try:
        f = open(path, "rb+")
    except FileNotFoundError:
        return
    with f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        f.seek(0)
        data = f.read()
        f.truncate(data.rfind(b"\n") + 1)  # 0 when the whole file is one unfinished line


def drop_rows_after(path, step):
    """Keep only the rows of steps up to ``step`` (and a cut last line goes): an elastic
    run that went back to its commit at ``step`` logs the steps after it again. The file
    is replaced whole (written beside it, then renamed)."""
    if not os.path.exists(path):
        return
    _drop_unfinished_line(path)
    with open(path, encoding="utf-8") as f:
        kept = [line for line in f if json.loads(line).get("step", 0) <= step]
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(tmp, path)


def read_metrics(path):
    """The rows of a metrics.jsonl as a list of dicts.

    A last line that does not parse is what a crash mid-write leaves behind: it
    is skipped with a warning. A bad line anywhere else means the file is not a
    log we wrote, and is a ValueError naming the line."""
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    while lines and not lines[-1].strip():
        lines.pop()
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            if number == len(lines):
                warnings.warn(f"{path}: skipped the last line ({number}), cut short (the run was "
                              f"probably stopped while writing it): {line[:60]!r}", stacklevel=2)
                break
            raise ValueError(f"{path}, line {number}: not a metrics record ({e}): {line[:60]!r}") from None
        rows.append(row)
    return rows


# -- the plot -------------------------------------------------------------

EVAL_FIELDS = ("accuracy", "eval_loss")  # the first one present goes on the right-hand axis


def _number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def plot_loss(metrics_path, png_path, title):
    """Draw training loss against wall time (field ``time``, seconds) and, when
    the log has one, the eval metric (``accuracy`` or ``eval_loss``, logged at
    some steps only) as markers on a second y axis. Returns png_path.

    A log without ``time`` is drawn against ``step`` instead."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = read_metrics(metrics_path)
    xkey = "time" if any("time" in r for r in rows) else "step"
    xlabel = "wall time (s)" if xkey == "time" else "step"
    fig = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    pts = [(r[xkey], r["loss"]) for r in rows if _number(r.get(xkey)) and _number(r.get("loss"))]
    if pts:
        ax.plot([x for x, _ in pts], [y for _, y in pts], color="tab:blue", linewidth=1.2, label="training loss")
    else:
        ax.text(0.5, 0.5, "no steps logged", transform=ax.transAxes, ha="center", va="center")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("training loss", color="tab:blue")
    ax.grid(True, alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    key = next((k for k in EVAL_FIELDS if any(_number(r.get(k)) for r in rows)), None)
    if key is not None:
        ev = [(r[xkey], r[key]) for r in rows if _number(r.get(xkey)) and _number(r.get(key))]
        ax2 = ax.twinx()
        ax2.plot([x for x, _ in ev], [y for _, y in ev], color="tab:orange", marker="o", linewidth=1,
                 label=key.replace("_", " "))
        ax2.set_ylabel(key.replace("_", " "), color="tab:orange")
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    if handles:
        ax.legend(handles, labels, loc="upper right")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(png_path, format="png")
    return png_path


# -- time to a fixed loss ---------------------------------------------------

TARGET_WINDOW = 10  # logged steps in the trailing mean of the training loss


def time_to_target(rows, target, window=TARGET_WINDOW):
    """When did the run first reach loss <= target? Returns the summary fields

        target_loss            the target
        time_to_target_s       first ``time`` at which the mean training loss of the
                               last ``window`` logged steps was <= target (one batch's
                               loss is too noisy to call a crossing on its own)
        time_to_target_eval_s  first ``time`` of an evaluation with eval_loss <= target

    each None when the run never got there. ``rows`` are metrics.jsonl's."""
    out = {"target_loss": target, "time_to_target_s": None, "time_to_target_eval_s": None}
    recent = []
    for r in rows:
        if not _number(r.get("time")):
            continue
        if _number(r.get("loss")):
            recent = (recent + [r["loss"]])[-window:]
            if out["time_to_target_s"] is None and len(recent) == window and sum(recent) / window <= target:
                out["time_to_target_s"] = r["time"]
        if out["time_to_target_eval_s"] is None and _number(r.get("eval_loss")) and r["eval_loss"] <= target:
            out["time_to_target_eval_s"] = r["time"]
    return out


# -- the summary table ------------------------------------------------------

def format_bytes(n):
    """Bytes in decimal units (1 MB = 10**6 bytes, as link bandwidths are quoted):
    512 -> '512 B', 1536 -> '1.54 KB', 2.5e9 -> '2.50 GB'."""
    n = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            break
        n /= 1000
    if unit == "B":
        return f"{int(n)} B"
    return f"{n:.0f} {unit}" if abs(n) >= 100 else f"{n:.2f} {unit}" if abs(n) < 10 else f"{n:.1f} {unit}"


def format_seconds(s):
    """'0.84 s', '12.3 s', '2 min 05 s', '1 h 02 min'."""
    if s < 10:
        return f"{s:.2f} s"
    if s < 60:
        return f"{s:.1f} s"
    m, sec = divmod(int(round(s)), 60)
    if m < 60:
        return f"{m} min {sec:02d} s"
    h, m = divmod(m, 60)
    return f"{h} h {m:02d} min"


def _share(summary, s):
    total = summary.get("time_training_s")
    return f" ({100 * s / total:.0f}% of training)" if _number(total) and total > 0 else ""


# key -> (label, format(value, summary)), in the order the table shows them.
# The keys are those trainer.run() writes to summary.json, the strategies' SUMMARY fields among them.
ROWS = {
    "model": ("model", None),
    "strategy": ("strategy", None),
    "backend": ("backend", None),
    "algorithm": ("algorithm", None),
    "compression": ("gradient compression", None),
    "workers": ("workers", None),
    "workers_at_start": ("workers at the start", None),
    "elastic": ("elastic", lambda v, s: f"at least {v['min_workers']}, at most {v['max_workers']} workers; a "
                                        f"commit every {v['commit_every']} steps ({v['commits']} in all); global "
                                        f"batch {v['global_batch']} ({v['batch']})"),
    "elastic_events": ("elastic events", lambda v, s: "\n".join(describe_event(e) for e in v)),
    "tensor_parallel": ("tensor-parallel size", None),
    "sequence_parallel": ("sequence parallelism", None),
    "parameter_bytes_per_worker": ("parameters per worker", lambda v, s: format_bytes(v)),
    "optimizer_bytes_per_worker": ("optimizer state per worker", lambda v, s: format_bytes(v)),
    "zero_stage": ("ZeRO stage", None),
    "zero_bytes_per_worker": ("held per worker after backward (measured)",
                              lambda v, s: ", ".join(f"{k} {format_bytes(n)}" for k, n in v.items())
                              + f"; {format_bytes(sum(v.values()))} in all"
                              + (f", against the paper's {format_bytes(s['zero_bytes_formula'])}"
                                 if s.get("zero_bytes_formula") else "")),
    "tensor_parallel_bytes_per_step": ("tensor-parallel collectives, last step",
                                       lambda v, s: ", ".join(f"{k.replace('_', '-')} {format_bytes(n)}"
                                                              for k, n in v.items() if n)),
    "tensor_parallel_bytes_per_layer": ("tensor-parallel collectives per layer, last step",
                                        lambda v, s: format_bytes(v)),
    "batch_per_worker": ("batch per worker", None),
    "steps": ("steps", None),
    "resumed_from": ("resumed from step", None),
    "final_loss": ("final loss", lambda v, s: f"{v:.4f}"),
    "accuracy": ("accuracy", lambda v, s: f"{100 * v:.2f}%"),
    "eval_loss": ("eval loss", lambda v, s: f"{v:.4f}"),
    "target_loss": ("target loss", lambda v, s: f"{v:.4f}"),
    "time_to_target_s": ("time to target (training loss, mean of 10 steps)", lambda v, s: format_seconds(v)),
    "time_to_target_eval_s": ("time to target (eval loss)", lambda v, s: format_seconds(v)),
    "samples_per_s": ("throughput (all workers)", lambda v, s: f"{v:,.0f} samples/s"),
    "batches_total": ("batches (all workers)", None),
    "time_wall_training_s": ("time, training loop (wall)", lambda v, s: format_seconds(v)),
    "straggler": ("straggler (rank:factor)", None),
    "jitter": ("jitter (probability:factor)", None),
    "lost_workers": ("workers lost (rank: batches it was last seen at)",
                     lambda v, s: ", ".join(f"{w['rank']}: {w['batches_at_last_heartbeat']}" for w in v)),
    "staleness_histogram": ("staleness of reads (clocks ahead: reads)", lambda v, s: _histogram(v)),
    "time_total_s": ("time, total", lambda v, s: format_seconds(v)),
    "started": ("rank 0 started as", None),
    "time_training_s": ("rank 0: time, training steps", lambda v, s: format_seconds(v)),
    "time_compute_s": ("rank 0: compute", lambda v, s: format_seconds(v) + _share(s, v)),
    "time_slowdown_s": ("rank 0: slowdown (--straggler, --jitter)", lambda v, s: format_seconds(v) + _share(s, v)),
    "time_comm_wait_s": ("rank 0: communication (exposed wait)", lambda v, s: format_seconds(v) + _share(s, v)),
    "time_comm_s": ("rank 0: communication (total, incl. any overlapped with backward)",
                    lambda v, s: format_seconds(v)),
    "bytes_communicated": ("bytes communicated", lambda v, s: format_bytes(v)),
    "bytes_pushed": ("rank 0: bytes pushed to the servers", lambda v, s: format_bytes(v)),
    "zero_bytes_formula": (None, None),   # shown within the row above
    "run_dir": ("run dir", None),
    "plot": ("plot", None),
    "checkpoint": ("checkpoint", None),
}


def _histogram(h, spell_out=6):
    """'0: 90 (90%), 1: 10 (10%)'; past spell_out lags, percentiles instead
    (summary.json keeps the whole histogram)."""
    pairs = sorted((int(lag), int(n)) for lag, n in h.items())
    total = sum(n for _, n in pairs) or 1
    if len(pairs) <= spell_out:
        return ", ".join(f"{lag}: {n} ({100 * n / total:.0f}%)" for lag, n in pairs)

    def percentile(q):
        seen = 0
        for lag, n in pairs:
            seen += n
            if seen >= q * total:
                return lag
        return pairs[-1][0]
    fresh = dict(pairs).get(0, 0)
    return (f"{total} reads: {100 * fresh / total:.0f}% at lag 0, median {percentile(0.5)}, "
            f"90th percentile {percentile(0.9)}, max {pairs[-1][0]}")


PER_WORKER = (  # (heading, key, format) of the per-worker table
    ("rank", "rank", str), ("batches", "batches", str), ("share", "share", lambda v: f"{100 * v:.1f}%"),
    ("compute", "compute_s", format_seconds), ("slowdown", "slowdown_s", format_seconds),
    ("comm wait", "comm_wait_s", format_seconds), ("loop", "loop_s", format_seconds),
    ("last loss", "last_loss", lambda v: f"{v:.4f}"))


def _cell(key, value, summary):
    fmt = ROWS.get(key, (None, None))[1]
    if fmt is not None and (_number(value) or (isinstance(value, (dict, list)) and value)):
        return fmt(value, summary)
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def render_summary(summary, console=None):
    """Print the run's final summary as a two-column table; returns the Table.

    Known keys (ROWS) come first, in a fixed order, with units; unknown keys
    follow as they are; keys that are missing or None are left out. The
    workers' own numbers (``per_worker``) follow as a second table."""
    table = Table(title="paratrain train: summary", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value", overflow="fold")
    known = [k for k in ROWS if k in summary]
    other = [k for k in summary if k not in ROWS and k != "per_worker"]
    for key in known + other:
        value = summary[key]
        if value is None or (key in ROWS and ROWS[key][0] is None):   # no label: shown within another row
            continue
        label = ROWS[key][0] if key in ROWS else key
        table.add_row(label, _cell(key, value, summary))
    console = console or Console()
    console.print(table)
    workers = summary.get("per_worker")
    if workers:
        per = Table(title="per worker", title_justify="left")
        for heading, _, _ in PER_WORKER:
            per.add_column(heading, justify="right")
        for w in workers:
            per.add_row(*(fmt(w[key]) if _number(w.get(key)) else "-" for _, key, fmt in PER_WORKER))
        console.print(per)
    return table
