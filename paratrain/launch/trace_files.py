"""The launcher's part of ``--trace``: a clean folder before the job, one trace after it.

On one machine the launcher merges its workers' files into DIR/trace.json
(trace/chrome.py). With ``--nnodes`` above 1 every launcher passes its
workers the same DIR. Where that is one shared folder, node 0 waits for
every rank's file to be complete (its process wrote the end line on
stopping) and merges them all, and the other nodes leave it to node 0.
Where each machine has a folder of its own, each merges its own ranks.
"""
import os
import time

from .watch import say

WAIT_FOR_OTHER_NODES = 60.0   # seconds node 0 waits for the other nodes' files to be complete


def remove_old(directory, ranks, world_size):
    """A trace folder used before holds the last job's files: remove this node's ranks'
    (node 0: also the servers' and those of ranks past this job's world), so the merge
    reads this job's alone. Not the other nodes' ranks': in a shared folder they may be
    writing already."""
    from ..trace import chrome
    mine = {chrome.rank_path(directory, r) for r in ranks}
    for path in chrome.process_files(directory):
        name = os.path.basename(path)
        index = name.split("-", 1)[1].split(".", 1)[0]
        stale = 0 in ranks and (name.startswith("server-") or not index.isdigit() or int(index) >= world_size)
        if path in mine or stale:
            os.remove(path)


def merge(directory, out, ranks, world_size):
    """This job's trace files into DIR/trace.json (or ``out``); says where, or why not."""
    from ..trace import chrome
    others = [r for r in range(world_size) if r not in ranks]
    shared = any(os.path.exists(chrome.rank_path(directory, r)) for r in others)
    if shared and 0 not in ranks:
        say(f"paratrain run: trace: node 0 merges every node's files in {directory}")
        return None
    if shared:
        deadline = time.monotonic() + WAIT_FOR_OTHER_NODES
        missing = others
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not chrome.finished(chrome.rank_path(directory, r))]
            time.sleep(0.1)
        if missing:
            say(f"paratrain run: trace: ranks {missing} did not finish their files within "
                f"{WAIT_FOR_OTHER_NODES:g}s; merging what there is")
    try:
        path = chrome.merge(directory, out, on_skip=lambda why: say(f"paratrain run: trace: left out {why}"))
    except (OSError, ValueError) as e:
        say(f"paratrain run: the trace was not merged: {e}")
        return None
    whose = "" if shared or not others else " (this node's ranks; the other nodes merge theirs in their own folders)"
    say(f"paratrain run: trace: {path}{whose} (open it in https://ui.perfetto.dev; `paratrain trace {directory}`)")
    return path
