"""trace.png: a few steps of every rank, one row per rank and row of the trace.

One colour per kind of span (compute, data, wait, transfer, the pipeline's
F/B/W), so a late rank shows as the others' red wait boxes lining up under
its longer compute.
"""
COLOURS = {"F": "#4C72B0", "B": "#55A868", "W": "#C44E52", "forward": "#4C72B0", "backward": "#55A868",
           "optimizer.step": "#8172B2", "compute": "#64B5CD", "data": "#999999", "wait": "#D62728",
           "transfer": "#FF9F1C", "checkpoint": "#8C564B", "user": "#CCB974"}
LEGEND = ("forward", "backward", "optimizer.step", "F", "B", "W", "compute", "data", "wait", "transfer")


def kind(e):
    if e["cat"] in ("wait", "transfer", "data", "checkpoint", "user"):
        return e["cat"]
    if e["cat"] == "compute":
        return e["name"] if e["name"] in COLOURS else "compute"
    return None


def window(events, steps):
    """(start, end) in us of the last ``steps`` steps of the lowest rank (all of it without steps)."""
    first = min((e["pid"] for e in events if e.get("ph") == "X"), default=0)
    marks = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("ph") == "X" and e["pid"] == first and e["cat"] == "step")
    if not marks:
        xs = [e for e in events if e.get("ph") == "X"]
        return min(e["ts"] for e in xs), max(e["ts"] + e["dur"] for e in xs)
    chosen = marks[-steps:] if len(marks) > steps else marks
    return chosen[0][0], chosen[-1][1]


def plot(events, path, title, steps=3):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    lo, hi = window(events, steps)
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e["name"] == "thread_name"}
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    rows = sorted({(e["pid"], e["tid"]) for e in events if e.get("ph") == "X" and kind(e)})
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(rows) + 1.8))
    for y, (pid, tid) in enumerate(rows):
        for e in events:
            if e.get("ph") != "X" or e["pid"] != pid or e["tid"] != tid or kind(e) is None:
                continue
            a, b = max(e["ts"], lo), min(e["ts"] + e["dur"], hi)
            if b > a:
                ax.barh(y, (b - a) / 1e3, left=(a - lo) / 1e3, height=0.8, color=COLOURS[kind(e)], linewidth=0)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{procs.get(p, p)}: {names.get((p, t), t)}" for p, t in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title)
    used = {kind(e) for e in events if e.get("ph") == "X" and kind(e)}
    ax.legend(handles=[Patch(color=COLOURS[k], label=k) for k in LEGEND if k in used],
              loc="upper center", bbox_to_anchor=(0.5, -0.12 - 1.0 / (len(rows) + 4)), ncol=6, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
