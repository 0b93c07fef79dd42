"""``paratrain trace --flight DIR``: line the ranks' flight-recorder dumps up and name where they part.

As PyTorch's flight-recorder analyzer matches sequence ids across ranks:
for each group, every member has made some number of calls; the first call
not every member made is where the job parted. For it, the report says who
made it (and in what state it is on each), who never arrived, and what
each missing rank completed last. A rank that left no dump was killed, or
never failed (a rank waiting forever does not dump until its timeout).
"""
import glob
import json
import os


def load_dumps(directory):
    paths = sorted(glob.glob(os.path.join(directory, "rank-*.json")))
    if not paths:
        raise FileNotFoundError(f"no flight-recorder dumps (rank-*.json) in {directory}: they are written on a "
                                "collective timeout, a dead peer, a mismatch, SIGUSR1 or an uncaught exception")
    dumps = {}
    for path in paths:
        with open(path) as f:
            d = json.load(f)
        dumps[int(d["rank"])] = d
    return dumps


def group_members(name, world_size):
    """A group's global ranks from its trace name: 'world', or 'g3[0,2]'."""
    if name == "world":
        return list(range(world_size))
    if "[" in name:
        return [int(x) for x in name[name.index("[") + 1:name.rindex("]")].split(",") if x]
    return None


def last_completed(records):
    done = [r for r in records if r["state"] == "completed"]
    return done[-1] if done else None


def partings(dumps):
    """For each group where the ranks disagree: (group, seq, op, made, missing, states)."""
    world_size = max(max(d.get("world_size", 0) for d in dumps.values()), max(dumps) + 1)
    groups = {}
    for rank, d in dumps.items():
        for name, calls in d.get("groups", {}).items():
            groups.setdefault(name, {})[rank] = calls
        for r in d["records"]:
            if r["seq"] is not None and r["peer"] is None:
                groups.setdefault(r["group"], {}).setdefault(rank, 0)
                groups[r["group"]][rank] = max(groups[r["group"]][rank], r["seq"])
    out = []
    for name, made in sorted(groups.items()):
        members = group_members(name, world_size) or sorted(made)
        seen = {r: made.get(r) for r in members}
        counts = [c for c in seen.values() if c is not None]
        if not counts or (len(counts) == len(members) and min(counts) == max(counts)
                          and not _unfinished(dumps, name, max(counts))):
            continue
        seq = min(counts) + 1 if min(counts) < max(counts) else max(counts)
        missing = [r for r, c in seen.items() if c is None or c < seq]
        states, ops = {}, {}
        for r in members:
            rec = next((x for x in dumps.get(r, {}).get("records", []) if x["group"] == name and x["seq"] == seq
                        and x["peer"] is None), None)
            if rec is not None:
                states[r], ops[r] = rec["state"], rec["op"]
        op = next(iter(ops.values())) if len(set(ops.values())) == 1 else None
        out.append({"group": name, "seq": seq, "op": op, "ops": ops, "made": sorted(states), "states": states,
                    "missing": missing, "no_dump": [r for r in members if r not in dumps]})
    return out


def _unfinished(dumps, group, seq):
    return any(x["group"] == group and x["seq"] == seq and x["state"] != "completed"
               for d in dumps.values() for x in d["records"])


def report(directory):
    """The report's lines."""
    dumps = load_dumps(directory)
    lines = [f"flight recorder: {len(dumps)} dumps in {directory} (ranks {sorted(dumps)})"]
    for rank, d in sorted(dumps.items()):
        lines.append(f"  rank {rank}: {d['reason']}")
    found = partings(dumps)
    if not found:
        lines.append("every group's ranks made the same calls and completed them: the ranks did not part")
    for p in found:
        what = f"{p['op'] or 'call'} #{p['seq']} of group {p['group']}"
        if len(set(p["ops"].values())) > 1:
            lines.append(f"the ranks part at call #{p['seq']} of group {p['group']}: they called different "
                         "collectives (" + ", ".join(f"rank {r} {op}" for r, op in sorted(p["ops"].items())) + ")")
        elif p["made"]:
            lines.append(f"the ranks part at {what}: ranks {p['made']} made it "
                         f"({', '.join(f'rank {r} {s}' for r, s in sorted(p['states'].items()))})")
        else:
            lines.append(f"the ranks part at {what}")
        if p["missing"]:
            lines.append(f"  ranks {p['missing']} never arrived")
        for r in p["missing"]:
            if r in dumps:
                last = last_completed(dumps[r]["records"])
                lines.append(f"  rank {r} last completed: " + (
                    f"{last['op']} #{last['seq']} of group {last['group']}" if last and last["seq"] is not None
                    else f"{last['op']} with rank {last['peer']}" if last else "nothing"))
            else:
                lines.append(f"  rank {r} left no dump (killed, or still waiting)")
    for rank, d in sorted(dumps.items()):
        stuck = [x for x in d["records"] if x["state"] in ("started", "queued") and x["peer"] is not None]
        for x in stuck[-1:]:
            lines.append(f"  rank {rank} was in {x['op']} with rank {x['peer']}")
    return lines
