"""From the workers' raw round times to what a reader looks at: a table, JSON and a plot.

Bandwidths follow nccl-tests (NVIDIA/nccl-tests, doc/PERFORMANCE.md):

    algbw = bytes / time
    busbw = algbw x 2(P-1)/P   all_reduce      (each rank sends and receives 2(P-1)/P of the buffer)
          = algbw x (P-1)/P    all_gather, reduce_scatter   (bytes = the whole P-piece buffer)
          = algbw              broadcast

busbw is comparable across collectives and world sizes: it is the rate at
which the busiest link (here: memory, or loopback TCP for Gloo) moves data.
The ratios are paratrain's busbw over the other engine's (above 1: paratrain
is faster); for a given size that equals the inverse ratio of times.

Beside the ratio of the medians, each ratio is also taken round by round: the
engines' turns in one round are adjacent in time, so the per-round ratio
cancels the drift of a shared machine (its speed moves within an hour) that
the two medians each carry. Its
median comes with a 95% interval, so "at parity" and "ahead" can be told apart.
"""
import json
from math import comb
from statistics import median

from rich.console import Console
from rich.table import Table

HEADER = ("bytes = the whole buffer: all_reduce/broadcast buffer, all_gather output and reduce_scatter input "
          "(world_size x per rank), as nccl-tests. time = median over rounds of the slowest rank's time "
          "per call (up to 1 MiB a round times 10 back-to-back calls, as nccl-tests loops; above, one); "
          "busbw = bytes/time x 2(P-1)/P (all_reduce), (P-1)/P (all_gather, reduce_scatter), 1 (broadcast). "
          "GB/s = 1e9 B/s. Engines interleaved round by round in one run. Under each ratio: the 95% interval "
          "of its median taken round by round (the engines' turns in one round are adjacent in time)")
REFERENCE = "paratrain"
LABELS = {"paratrain": "paratrain shm", "paratrain-hier": "pt hier 2 hosts", "gloo": "Gloo", "mpi": "Open MPI"}


def label(engine):
    """Column names short enough that seven engines fit a 200-column table."""
    if engine.startswith("paratrain/"):
        return "pt " + engine.split("/", 1)[1]
    return LABELS.get(engine, engine)


def bus_factor(collective, P):
    """nccl-tests' factors (doc/PERFORMANCE.md): busbw = algbw x this."""
    return {"all_reduce": 2 * (P - 1) / P, "all_gather": (P - 1) / P, "reduce_scatter": (P - 1) / P,
            "broadcast": 1.0, "reduce": 1.0, "gather": (P - 1) / P, "scatter": (P - 1) / P,
            "all_to_all": (P - 1) / P}[collective]


def size_label(n):
    """4096 -> "4 KiB"; sizes rounded to a world size that does not divide them stay in bytes."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n:,} B"


def summarize(rows, P):
    """Medians and bandwidths per row (rows as the workers wrote them, samples in seconds)."""
    out = []
    for r in rows:
        s = r["samples_s"]
        t = median(s)
        algbw = r["bytes"] / t / 1e9 if t > 0 else float("nan")
        out.append(dict(
            collective=r["collective"], engine=r["engine"], bytes=r["bytes"], count=r["count"], iters=r["iters"],
            calls=r.get("calls", 1),
            verified=r["verified"], note=r["note"], run=r.get("run", "main"),
            median_us=t * 1e6, min_us=min(s) * 1e6, max_us=max(s) * 1e6,
            algbw_GBps=algbw, busbw_GBps=algbw * bus_factor(r["collective"], P),
            samples_us=[x * 1e6 for x in s]))
    return out


def engine_order(results):
    names = []
    for r in results:
        if r["engine"] not in names:
            names.append(r["engine"])
    rank = {"paratrain": 0, "gloo": 2, "mpi": 3, "paratrain-hier": 4}
    return sorted(names, key=lambda n: (rank.get(n, 1), names.index(n)))


def median_interval(xs, confidence=0.95):
    """(median, low, high): the sample median and a distribution-free interval for the
    population median from order statistics. The number of samples below the median
    is Binomial(n, 1/2), so [x_(k), x_(n+1-k)] (1-based) holds the median with
    probability 1 - 2 P(Binom(n, 1/2) < k); k is the largest rank that keeps that at
    least ``confidence`` (Conover, Practical Nonparametric Statistics, sec. 3.2).
    Too few samples for any such k: the whole range."""
    x = sorted(xs)
    n = len(x)
    tail, below, k = (1 - confidence) / 2, 0, 0
    while k < n // 2:
        below += comb(n, k)   # P(Binom < k + 1) * 2**n
        if below > tail * 2 ** n:
            break
        k += 1
    return median(x), x[max(k, 1) - 1], x[n - max(k, 1)]


def paired_ratio(ref, other):
    """paratrain busbw / other busbw round by round (other's time / paratrain's in the
    same round): (median, low, high) as median_interval; None unless both engines
    have one sample per round of the same rounds."""
    a, b = ref["samples_us"], other["samples_us"]
    if len(a) != len(b) or not a or ref.get("run", "main") != other.get("run", "main"):
        return None
    return median_interval([y / x for x, y in zip(a, b) if x > 0])


def ratios(results):
    """paratrain busbw / other busbw per (collective, size), as the ratio of the medians and
    round by round (``paired_*``: median, 95% low, high), and 4 KiB-ish latency ratios."""
    by = {(r["collective"], r["bytes"], r["engine"]): r for r in results}
    out = []
    for (c, b, e), ref in by.items():
        if e != REFERENCE:
            continue
        row = dict(collective=c, bytes=b)
        for other in ("gloo", "mpi"):
            o = by.get((c, b, other))
            if o and ref["verified"] and o["verified"]:
                row[f"busbw_paratrain_over_{other}"] = ref["busbw_GBps"] / o["busbw_GBps"]
                row[f"time_paratrain_over_{other}"] = ref["median_us"] / o["median_us"]
                paired = paired_ratio(ref, o)
                if paired is not None:
                    row[f"paired_busbw_paratrain_over_{other}"] = list(paired)
        out.append(row)
    return out


def _fmt_us(us):
    return f"{us:,.1f}" if us < 99.95 else f"{us:,.0f}"


def _fmt_ratio(x):
    return "-" if x is None else f"{x:.2f}x"


def _fmt_paired(row, other):
    """The ratio of medians, and under it the per-round ratio's 95% interval."""
    cell = _fmt_ratio(row.get(f"busbw_paratrain_over_{other}"))
    paired = row.get(f"paired_busbw_paratrain_over_{other}")
    if paired is not None:
        cell += f"\n[dim]{paired[1]:.2f}-{paired[2]:.2f}[/dim]"
    return cell


def table(results, P, cpus):
    engines = engine_order(results)
    by = {(r["collective"], r["bytes"], r["engine"]): r for r in results}
    rat = {(r["collective"], r["bytes"]): r for r in ratios(results)}
    t = Table(title=f"Collectives: {P} ranks on {cpus} cores, float32, time in us, busbw in GB/s",
              caption=HEADER, caption_justify="left")
    t.add_column("collective", no_wrap=True)
    t.add_column("bytes", justify="right", no_wrap=True)
    for e in engines:
        t.add_column(f"{label(e)}\ntime", justify="right")
        t.add_column("busbw", justify="right")
    others = [o for o in ("gloo", "mpi") if o in engines]
    for o in others:
        t.add_column(f"busbw\npt/{LABELS[o]}", justify="right", style="bold")
    keys = sorted({(r["collective"], r["bytes"]) for r in results}, key=lambda k: (_coll_rank(k[0]), k[1]))
    last = None
    for c, b in keys:
        if last is not None and c != last:
            t.add_section()
        last = c
        cells = [c, size_label(b)]
        for e in engines:
            r = by.get((c, b, e))
            if r is None:
                cells += ["", ""]
            elif not r["verified"]:
                cells += ["[red]WRONG[/red]", "[red]WRONG[/red]"]
            else:
                mark = "*" if r["note"] else ""
                cells += [_fmt_us(r["median_us"]) + mark, f"{r['busbw_GBps']:.3f}{mark}"]
        for o in others:
            cells.append(_fmt_paired(rat.get((c, b), {}), o))
        t.add_row(*cells)
    return t


def latency_table(results):
    """The smallest size of each collective (4 KiB by default): latency, not bandwidth."""
    engines = engine_order(results)
    by = {(r["collective"], r["bytes"], r["engine"]): r for r in results}
    rat = {(r["collective"], r["bytes"]): r for r in ratios(results)}
    colls = sorted({r["collective"] for r in results}, key=_coll_rank)
    smallest = {c: min(r["bytes"] for r in results if r["collective"] == c) for c in colls}
    sizes = sorted(set(smallest.values()))
    t = Table(title=f"Latency at {', '.join(size_label(s) for s in sizes)}: time in us; "
                    "ratio = paratrain time / other time (below 1: paratrain is faster)")
    t.add_column("collective", no_wrap=True)
    t.add_column("bytes", justify="right", no_wrap=True)
    for e in engines:
        t.add_column(label(e), justify="right")
    others = [o for o in ("gloo", "mpi") if o in engines]
    for o in others:
        t.add_column(f"pt/{LABELS[o]}", justify="right", style="bold")
    for c in colls:
        b = smallest[c]
        cells = [c, size_label(b)]
        for e in engines:
            r = by.get((c, b, e))
            cells.append("" if r is None else ("[red]WRONG[/red]" if not r["verified"] else _fmt_us(r["median_us"])))
        for o in others:
            cells.append(_fmt_ratio(rat.get((c, b), {}).get(f"time_paratrain_over_{o}")))
        t.add_row(*cells)
    return t


def _coll_rank(c):
    order = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
    return order.index(c) if c in order else len(order)


def print_report(results, P, cpus, notes, console=None):
    console = console or Console()
    console.print(table(results, P, cpus))
    console.print(latency_table(results))
    for n in notes:
        console.print(n)


def write_json(path, results, meta):
    with open(path, "w") as f:
        json.dump(dict(meta, results=results, ratios=ratios(results)), f, indent=1)


def plot(path, results, P):
    """busbw vs size, one panel per collective, one line per engine (log-x). Agg
    canvas on a bare Figure: no pyplot, so no global backend is switched."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    colls = sorted({r["collective"] for r in results}, key=_coll_rank)
    engines = engine_order(results)
    fig = Figure(figsize=(5 * len(colls), 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(colls), squeeze=False)[0]
    for ax, c in zip(axes, colls):
        sizes = sorted({r["bytes"] for r in results if r["collective"] == c})
        for e in engines:
            pts = sorted((r["bytes"], r["busbw_GBps"]) for r in results
                         if r["collective"] == c and r["engine"] == e and r["verified"])
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label(e))
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [size_label(s).replace(" ", "") for s in sizes])
        ax.set_title(c)
        ax.set_xlabel("bytes (whole buffer, nccl-tests convention)")
        ax.set_ylabel("busbw (GB/s)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"{' vs '.join(label(e) for e in engines)}: {P} ranks, float32, median busbw")
    fig.savefig(path, dpi=110)
