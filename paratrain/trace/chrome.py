"""The ranks' files merged into one Chrome trace: what Perfetto and chrome://tracing open.

Every rank (and parameter server) is a process of the trace; its rows
(threads) are compute, data, and one per communication group. Times are
moved onto rank 0's clock with each file's measured offset (clock.py).

The merge is also where a collective is split in two, as Horovod's timeline
shows NEGOTIATE before ALLREDUCE: the same call (group, sequence id) is
found on every rank, the last rank to start it is the one everyone waited
for, and on each rank the call becomes *wait* (from its own start to the
last rank's) and *transfer* (the rest). A message is split the same way on
its receiver: waiting until its sender started sending. Flow arrows join a
collective's slices across ranks, and a message's send to its receive.

The format: https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU
(complete events ``ph: X``, metadata ``ph: M``, flow events ``ph: s/t/f``).
"""
import glob
import gzip
import json
import os

GZIP_ABOVE = 64 << 20   # bytes of JSON past which the trace is written gzipped
SERVER_PID = 1000       # parameter server i is process SERVER_PID + i
FIXED_TRACKS = {"compute": 1, "data": 2}


def read_rank_file(path):
    """(header, spans) of one process's file, its spans as dicts on rank 0's clock."""
    with open(path) as f:
        lines = f.read().splitlines()
    if not lines:
        raise ValueError(f"{path} is empty: the process that writes it did not start recording")
    header = json.loads(lines[0])
    offset = header.get("offset_s") or 0.0
    spans = []
    for line in lines[1:]:
        try:
            name, cat, track, t0, t1, args = json.loads(line)
        except ValueError:
            break   # END, or the last line of a process killed mid-write
        spans.append({"name": name, "cat": cat, "track": track, "t0": t0 + offset, "t1": t1 + offset,
                      "args": args or {}})
    return header, spans


END = {"end": True}   # a process's last line, written as it stops recording (recorder.py)


def rank_path(directory, rank):
    return os.path.join(directory, f"rank-{rank}.jsonl")


def finished(path):
    """Whether a process's file is complete: it stopped recording and wrote END."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64))
            tail = f.read()
    except OSError:
        return False
    return tail.rstrip().endswith(json.dumps(END).encode())


def process_id(header):
    return header["index"] + (SERVER_PID if header["role"] == "server" else 0)


def split_waits(processes):
    """Give every matched collective and received message ``wait`` (seconds spent
    waiting for the last peer) and ``late`` (that peer's global rank), in place."""
    calls = {}
    for _, spans in processes:
        for s in spans:
            a = s["args"]
            if s["cat"] == "comm" and "seq" in a:
                calls.setdefault((a["group"], a["seq"]), []).append(s)
    for key, same in calls.items():
        if len(same) < len(same[0]["args"]["ranks"]) or len({s["name"] for s in same}) != 1:
            continue   # a rank's file is missing, or the ranks disagree: nothing to split
        last = max(same, key=lambda s: s["t0"])
        for s in same:
            s["wait"] = max(0.0, min(s["t1"], last["t0"]) - s["t0"])
            s["late"] = last["args"]["rank"]
    sends = {}
    for _, spans in processes:
        for s in spans:
            a = s["args"]
            if s["cat"] == "comm" and "src" in a and a["src"] == a["rank"]:
                sends[_message_key(a)] = s
    for _, spans in processes:
        for s in spans:
            a = s["args"]
            if s["cat"] == "comm" and "dst" in a and a["dst"] == a["rank"] and not a.get("posted"):
                send = sends.get(_message_key(a))
                if send is not None:
                    s["wait"] = max(0.0, min(s["t1"], send["t0"]) - s["t0"])
                    s["late"] = a["src"]
                    s["send"] = send
    split_rounds(processes)
    return calls


PUSHES = ("push", "push_packed")


def split_rounds(processes):
    """A BSP parameter-server step waits for the round: its servers answer once every
    worker has pushed for that clock. Each worker's ``ps.step`` of clock c gets ``wait``,
    from its own last push of c reaching a server to the last worker's (on the server
    where that was longest), and ``late``, that worker's rank; and ``group``/``seq``
    ("ps", c), so the analysis tallies who the rounds waited for as it does collectives."""
    arrivals = {}   # (server, clock) -> {worker: start of its last push of that clock}
    for header, spans in processes:
        if header["role"] != "server":
            continue
        for s in spans:
            a = s["args"]
            if s["name"] in PUSHES and a.get("mode") == "bsp" and "clock" in a:
                got = arrivals.setdefault((header["index"], a["clock"]), {})
                got[a["worker"]] = max(got.get(a["worker"], s["t0"]), s["t0"])
    if not arrivals:
        return
    by_clock = {}
    for (_, clock), got in arrivals.items():
        by_clock.setdefault(clock, []).append(got)
    for header, spans in processes:
        if header["role"] != "rank":
            continue
        for s in spans:
            a = s["args"]
            if s["name"] != "ps.step" or a.get("clock") not in by_clock:
                continue
            me, waits = header["index"], []
            for got in by_clock[a["clock"]]:
                if me in got:
                    late = max(got, key=got.get)
                    waits.append((max(0.0, min(s["t1"], s["t0"] + got[late] - got[me]) - s["t0"]), late))
            if waits:
                s["wait"], s["late"] = max(waits)
                a["group"], a["seq"] = "ps", a["clock"]


def _message_key(a):
    return a["group"], a["src"], a["dst"], a["tag"], a["n"]


def process_files(directory):
    """The processes' own files in a trace folder: the ranks', then the servers'."""
    return sorted(glob.glob(os.path.join(directory, "rank-*.jsonl"))) + \
        sorted(glob.glob(os.path.join(directory, "server-*.jsonl")))


def merge(directory, out=None, gzip_above=GZIP_ABOVE, on_skip=None):
    """Merge ``directory``'s rank-*.jsonl and server-*.jsonl into one Chrome trace;
    returns its path (``directory/trace.json``, or ``.json.gz`` when large). With
    ``on_skip(why)``, a file that cannot be read (a process killed before it wrote
    anything) is left out and said, instead of failing the merge."""
    files = process_files(directory)
    if not files:
        raise FileNotFoundError(f"no rank-*.jsonl in {directory}: was the job run with --trace "
                                "(or PARATRAIN_TRACE) and did its ranks call pt.init()?")
    processes = []
    for f in files:
        try:
            processes.append(read_rank_file(f))
        except ValueError as e:
            if on_skip is None:
                raise
            on_skip(str(e))
    if not processes:
        raise ValueError(f"no trace file in {directory} could be read")
    calls = split_waits(processes)
    events = chrome_events(processes, calls)
    data = json.dumps({"traceEvents": events, "displayTimeUnit": "ms",
                       "otherData": {"clocks": [{k: h.get(k) for k in ("role", "index", "host", "offset_s",
                                                                          "uncertainty_s")}
                                                for h, _ in processes]}})
    out = out or os.path.join(directory, "trace.json")
    for stale in (out, out + ".gz"):
        if os.path.exists(stale):
            os.remove(stale)
    if len(data) > gzip_above:
        out += ".gz"
        with gzip.open(out, "wt") as f:
            f.write(data)
    else:
        with open(out, "w") as f:
            f.write(data)
    return out


def chrome_events(processes, calls):
    starts = [s["t0"] for _, spans in processes for s in spans]
    origin = min(starts) if starts else 0.0

    def us(t):
        return round((t - origin) * 1e6, 3)

    events, messages = [], []
    for header, spans in processes:
        pid = process_id(header)
        label = f"rank {header['index']}" if header["role"] == "rank" else f"server {header['index']}"
        events.append({"ph": "M", "pid": pid, "name": "process_name", "args": {"name": label}})
        events.append({"ph": "M", "pid": pid, "name": "process_sort_index", "args": {"sort_index": pid}})
        tracks = dict(FIXED_TRACKS)
        for s in spans:
            tid = tracks.setdefault(s["track"], 10 + len(tracks))
            s["pid"], s["tid"] = pid, tid
            a = dict(s["args"])
            if "wait" in s:
                a["wait_us"], a["waited_for_rank"] = round(s["wait"] * 1e6, 3), s["late"]
            events.append({"ph": "X", "name": s["name"], "cat": s["cat"], "pid": pid, "tid": tid,
                           "ts": us(s["t0"]), "dur": us(s["t1"]) - us(s["t0"]), "args": a})
            if "wait" in s:
                mid = s["t0"] + s["wait"]
                events.append({"ph": "X", "name": "wait", "cat": "wait", "pid": pid, "tid": tid, "ts": us(s["t0"]),
                               "dur": us(mid) - us(s["t0"]), "args": {"for_rank": s["late"]}})
                events.append({"ph": "X", "name": "transfer", "cat": "transfer", "pid": pid, "tid": tid,
                               "ts": us(mid), "dur": us(s["t1"]) - us(mid), "args": {}})
            if "send" in s:
                messages.append((s["send"], s))
        for track, tid in tracks.items():
            events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": track}})
            events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})
    chains = [sorted(same, key=lambda s: s["args"]["rank"]) for same in calls.values() if len(same) > 1]
    chains += [list(pair) for pair in messages]
    for flow_id, chain in enumerate(chains, 1):
        for i, s in enumerate(chain):
            ph = "s" if i == 0 else "f" if i == len(chain) - 1 else "t"
            e = {"ph": ph, "id": flow_id, "name": s["name"], "cat": "flow", "pid": s["pid"], "tid": s["tid"],
                 "ts": us(s["t0"])}
            if ph == "f":
                e["bp"] = "e"
            events.append(e)
    return events
