"""Where each rank's step time went, who was late, and what it cost: ``paratrain trace``.

The breakdown is Holistic Trace Analysis's temporal breakdown (compute /
non-overlapped communication / idle) made for CPU runs, where HTA gives
none (it reads GPU kernels only), with the wait split out: within each
step, a moment counts once, in the first of

    compute   a forward, backward, optimizer step, pipeline F/B/W, evaluation
    data      reading the batch
    wait      inside a collective or a receive, before the last peer arrived
    exposed   inside communication, moving bytes, with no compute beside it
    idle      none of these (a slower machine's pause, Python between calls)

so the five sum to the step time. A collective the compute thread blocks
in (a tensor-parallel layer's all-reduce, ZeRO-3's gather inside a
forward; comm/ marks it ``blocking``) is not compute though it lies inside
a forward's span: the compute thread was waiting, or moving the bytes, and
nothing else ran. A call on a group's lane (``async_op``: DataParallel's
bucket all-reduces) runs beside the compute, which goes on.
``overlap`` is the share of
communication time that had compute running beside it (DataParallel's
bucket all-reduces under backward). ``starved`` is the part of compute in
which the rank was ready but got no CPU (its wall time less its thread's
CPU time, counted where a worker computes on one thread, less the blocking
calls inside it): more ranks than cores, or another job, not the rank
itself. (A blocking call's CPU, a spinning wait's, stays in the thread's
CPU time, so starved is then a lower bound.)

A rank's *own work* is its step time less its wait and its starved time:
what it would take if nobody were late and it had its core to itself. A
straggler is a rank whose own work per step is at least 10% above the
median of the ranks.

Under the parameter server, the servers note every read with the reader's
lag, and the analysis gives each worker's staleness.
"""
import gzip
import json
import os
import statistics

from .chrome import SERVER_PID

STRAGGLER_FACTOR = 1.10
COMPUTE = ("compute",)


def find_trace(path):
    """The trace file for a run folder, a trace folder or a file."""
    if os.path.isdir(path):
        for name in ("trace.json", "trace.json.gz", os.path.join("trace", "trace.json"),
                     os.path.join("trace", "trace.json.gz")):
            if os.path.exists(os.path.join(path, name)):
                return os.path.join(path, name)
        raise FileNotFoundError(f"no trace.json in {path}: train with --trace, or run with --trace DIR")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist")
    return path


def load(path):
    """The trace's events (a list of dicts), from trace.json or trace.json.gz."""
    path = find_trace(path)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


# ---- intervals: sorted lists of disjoint (start, end) -----------------------------

def union(intervals):
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def intersect(xs, ys):
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(xs, ys):
    out = []
    for a, b in xs:
        for c, d in ys:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
            if a >= b:
                break
        if a < b:
            out.append((a, b))
    return out


def length(xs):
    return sum(b - a for a, b in xs)


# ---- the analysis -----------------------------------------------------------------

def by_rank(events):
    """{rank: [complete events]} for the ranks (not the servers)."""
    ranks = {}
    for e in events:
        if e.get("ph") == "X" and e["pid"] < SERVER_PID:
            ranks.setdefault(e["pid"], []).append(e)
    return ranks


def spans(events, cats, names=None):
    return union([(e["ts"], e["ts"] + e["dur"]) for e in events
                  if e["cat"] in cats and (names is None or e["name"] in names)])


def blocking_calls(events):
    """The collectives the calling thread waited in (not on a lane, beside it)."""
    return union([(e["ts"], e["ts"] + e["dur"]) for e in events
                  if e["cat"] == "comm" and (e.get("args") or {}).get("blocking")])


def breakdown(events):
    """Per rank: steps, step_s, compute_s, data_s, wait_s, exposed_comm_s, idle_s,
    overlap, starved_s, own_work_s (per step), and the pipeline's bubble where it ran F/B/W."""
    rows = []
    for rank, evs in sorted(by_rank(events).items()):
        steps = spans(evs, ("step",))
        if not steps:   # a script without the trainer's steps: the whole recording is one
            steps = [(min(e["ts"] for e in evs), max(e["ts"] + e["dur"] for e in evs))]
        blocked = intersect(blocking_calls(evs), steps)
        compute = subtract(intersect(spans(evs, COMPUTE), steps), blocked)
        data = subtract(intersect(spans(evs, ("data",)), steps), compute)
        busy = union(compute + data)
        wait = subtract(intersect(spans(evs, ("wait",)), steps), busy)
        comm = intersect(spans(evs, ("comm",)), steps)
        exposed = subtract(subtract(comm, busy), wait)
        step_us = length(steps)
        parts = {"compute": length(compute), "data": length(data), "wait": length(wait), "exposed": length(exposed)}
        comm_us = length(comm)
        starved = sum(max(0.0, e["dur"] - length(intersect([(e["ts"], e["ts"] + e["dur"])], blocked))
                          - e["args"]["cpu_s"] * 1e6) for e in evs
                      if e["cat"] == "compute" and "cpu_s" in (e.get("args") or {}) and _inside(e, steps))
        row = {"rank": rank, "steps": len(steps), "step_s": step_us / 1e6,
               "compute_s": parts["compute"] / 1e6, "data_s": parts["data"] / 1e6,
               "exposed_comm_s": parts["exposed"] / 1e6, "wait_s": parts["wait"] / 1e6,
               "idle_s": max(0.0, step_us - sum(parts.values())) / 1e6,
               "overlap": length(intersect(comm, compute)) / comm_us if comm_us else 0.0,
               "starved_s": starved / 1e6,
               "own_work_s": (step_us - parts["wait"] - starved) / 1e6 / len(steps)}
        stage_work = subtract(intersect(spans(evs, COMPUTE, ("F", "B", "W")), steps), blocked)
        if stage_work:
            row["bubble"] = 1.0 - length(stage_work) / step_us
        rows.append(row)
    return rows


def _inside(e, steps):
    """Whether event e lies within one of the (sorted, disjoint) steps."""
    t = e["ts"]
    return any(a <= t and t + e["dur"] <= b for a, b in steps)


def stragglers(rows, factor=STRAGGLER_FACTOR):
    """Ranks whose own work per step is at least ``factor`` x the median rank's."""
    if len(rows) < 2:
        return []
    median = statistics.median(r["own_work_s"] for r in rows)
    return [{"rank": r["rank"], "factor": r["own_work_s"] / median} for r in rows
            if median > 0 and r["own_work_s"] >= factor * median]


def last_arrivals(events, steps):
    """For each kind of collective: the rank the others waited for longest, how often it
    arrived last, and what the others waited for it per step (the rank that is last most
    often may cost little: two ranks a hair apart take turns, while a third, late less
    often, holds everyone for milliseconds). Only the calls inside every caller's steps count
    there; those before the first step and after the last (the setup's, a pipeline
    timing its cut, the final checkpoint's) are tallied apart, their waits in seconds
    in all (``outside``), so a long setup is not read as a slow step."""
    inside, outside = {}, {}
    step_spans = {rank: spans(evs, ("step",)) for rank, evs in by_rank(events).items()}
    for e in events:
        a = e.get("args") or {}
        if e.get("ph") == "X" and e["cat"] == "comm" and "seq" in a and "waited_for_rank" in a:
            inside.setdefault((a["group"], a["seq"]), []).append(e)
    for key, same in list(inside.items()):
        if not all(_inside(e, step_spans[e["pid"]]) for e in same if step_spans.get(e["pid"])):
            outside[key] = inside.pop(key)
    return _tally(inside, lambda us: us / 1e6 / max(1, steps), "others_wait_s_per_step") + \
        [dict(row, outside=True) for row in _tally(outside, lambda us: us / 1e6, "others_wait_s")]


def _tally(calls, scale, key):
    """Per kind of collective among ``calls`` ({(group, seq): its ranks' events}): the rank
    the others waited for longest in all, its share of the calls, and that wait, scaled."""
    tally = {}
    for same in calls.values():
        op, late = same[0]["name"], same[0]["args"]["waited_for_rank"]
        t = tally.setdefault(op, {"calls": 0, "last": {}, "wait_us": {}})
        t["calls"] += 1
        t["last"][late] = t["last"].get(late, 0) + 1
        t["wait_us"][late] = t["wait_us"].get(late, 0.0) + sum(e["args"]["wait_us"] for e in same)
    out = []
    for op, t in sorted(tally.items()):
        rank = max(t["last"], key=lambda r: (t["wait_us"][r], t["last"][r]))
        count = t["last"][rank]
        out.append({"op": op, "rank": rank, "share": count / t["calls"], "calls": t["calls"],
                    key: scale(t["wait_us"][rank])})
    return out


def staleness(events):
    """Per parameter-server worker: the reads the servers answered it, and how many clocks
    it was ahead of the slowest worker at each (its lag: SSP bounds it by s, BSP keeps it
    0, ASP lets it grow; Ho et al., NIPS 2013)."""
    lags = {}
    for e in events:
        if e.get("ph") == "X" and e["cat"] == "ps" and e["name"] == "read":
            lags.setdefault(e["args"]["worker"], []).append(e["args"]["lag"])
    return [{"worker": w, "reads": len(v), "mean_lag": sum(v) / len(v), "max_lag": max(v),
             "histogram": {str(k): v.count(k) for k in sorted(set(v))}} for w, v in sorted(lags.items())]


def analyse(path, events=None):
    """Everything ``paratrain trace`` prints, as one dict (its --json); ``events``: the
    trace at ``path`` when the caller has loaded it already."""
    trace_file = find_trace(path)
    events = load(trace_file) if events is None else events
    rows = breakdown(events)
    steps = max((r["steps"] for r in rows), default=0)
    return {"trace": trace_file, "ranks": rows, "stragglers": stragglers(rows),
            "last_arrivals": last_arrivals(events, steps), "staleness": staleness(events)}
