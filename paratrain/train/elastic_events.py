"""What an elastic run went through, as summary.json's ``elastic_events`` and as a sentence.

Each change of the world is one event per kind, built from what the launcher saw
(comm/elastic_rendezvous.changes: who died or started, and when) and what the
workers agreed at the re-form (the latest moment a survivor knew, the furthest
step one had reached, the commit they went back to):

    {"step": 123, "kind": "lost", "ranks": [2], "world_size": 3,
     "detect_s": 0.21, "resume_s": 0.62, "commit_step": 120, "steps_redone": 3}

``step`` is the step the job had reached when it happened; ``ranks`` are the lost
workers' ranks in the world they left, or the joiners' in the world they joined;
``detect_s`` runs from the death to the last survivor knowing (the death: when the
launcher saw the worker's exit, or, if earlier, when the first survivor's collective
failed; for a hang, its last heartbeat; for a join, the replacement's start);
``resume_s`` from the same moment to the first step done at the new size. No torch
here: the front-end reads these too.
"""


def from_changes(changes, caught_at, at_step, commit_step, world_size, first_caught=float("inf")):
    """The events of one re-form (possibly none: a world re-formed with nobody lost or
    joined, or a first world). ``caught_at`` and ``first_caught``: when the last and the
    first survivor knew (time.time(); 0 and inf: none did); ``at_step``: the furthest
    step a survivor had done."""
    events = []
    for kind, who in (("lost", changes.get("lost", [])), ("joined", changes.get("joined", []))):
        if not who:
            continue
        since = min(w["at"] for w in who)
        if kind == "lost":
            since = min(since, first_caught)
        events.append({"step": max(at_step, commit_step), "kind": kind,
                       "ranks": sorted(w["rank"] for w in who if w.get("rank") is not None),
                       "workers": sorted(w["id"] for w in who),
                       "world_size": world_size, "detect_s": max(0.0, caught_at - since) if caught_at else None,
                       "resume_s": None, "commit_step": commit_step,
                       "steps_redone": max(0, at_step - commit_step), "_since": since})
    return events


def resumed(events, now):
    """The first step at the new size is done at ``now``: the events' resume times."""
    for e in events:
        e["resume_s"] = max(0.0, now - e.pop("_since"))


def describe(e):
    """One line for the progress output and the summary."""
    ranks = ", ".join(map(str, e["ranks"])) or "?"
    ids = ", ".join(map(str, e.get("workers", ())))
    who = f"rank{'s' if len(e['ranks']) > 1 else ''} {ranks}" + (f" (worker{'s' if ',' in ids else ''} {ids})"
                                                                  if ids and ids != ranks else "")
    resume = f" in {e['resume_s']:.2f} s" if e.get("resume_s") is not None else ""
    if e["kind"] == "lost":
        redone = e["steps_redone"]
        return (f"{who} lost at step {e['step']}; resumed on {_workers(e['world_size'])}{resume} from the commit "
                f"at step {e['commit_step']} ({redone} step{'s' if redone != 1 else ''} redone, 0 samples repeated)")
    return (f"{who} joined at step {e['commit_step']}; {_workers(e['world_size'])} training{resume} after the "
            f"new worker's start")


def _workers(n):
    return f"{n} worker{'s' if n != 1 else ''}"
