"""The stall inspector: a rank stuck in a call says, once, who it waits for and what they are doing.

Horovod's stall inspector warns after 60 s that a tensor is "waiting for
remainder of ranks" and lists them; this one also shows each missing rank's
Python stack. Every rank runs a watchdog thread that wakes a few times per
``PARATRAIN_STALL_S`` (default 60):

- if this rank's oldest unfinished call (the flight recorder's, flight.py)
  started more than STALL_S ago, it asks the others, through the job's
  store, how far each of them got in that call's group, and for their
  stacks; then it logs the call, its group and sequence id, the ranks that
  have not made that call yet (or, for a receive, the sender), and each of
  their stacks. Once per call; the call goes on waiting until
  PARATRAIN_TIMEOUT, whose error names the same ranks;
- if another rank has asked, it answers: for each of its groups, the calls
  made so far, and its main thread's stack.

Only JSON travels through the store; nothing is unpickled. The hot path
pays nothing: the watchdog reads the ring the calls already fill.
"""
import json
import sys
import threading
import time
import traceback

from . import flight

ANSWER_WAIT_S = 2.0   # how long an asking rank waits for the others' answers (and their dumps)


class Watchdog(threading.Thread):
    def __init__(self, store, rank, world_size, stall_s, log=None):
        super().__init__(name="paratrain-stall-watchdog", daemon=True)
        self.store, self.rank, self.world_size, self.stall_s = store, rank, world_size, stall_s
        self.period = min(0.5, stall_s / 8)
        self.log = log or (lambda text: print(text, file=sys.stderr, flush=True))
        self.reported = set()   # (group, seq) already logged
        self.answered = 0       # asks answered so far
        self.dumps_done = 0     # dump requests answered so far
        self.dumps_asked = 0    # this rank's own request, once made
        self.stopped = threading.Event()
        flight.ask_peers = self.ask_for_dumps

    def run(self):
        while not self.stopped.wait(self.period):
            try:
                self.answer()
                self.inspect()
            except Exception:   # the store is gone: the job is ending (its own errors say why)
                return

    def stop(self):
        self.stopped.set()
        if flight.ask_peers == self.ask_for_dumps:
            flight.ask_peers = None

    # ---- answering ------------------------------------------------------------------

    def answer(self):
        wanted = self.store.add("flight/asks", 0)
        if wanted > self.dumps_done:
            self.dumps_done = wanted
            flight.dump(f"asked by another rank, whose call failed (request {wanted})")
            self.store.set(f"flight/dumped/{self.rank}", str(wanted))
        asks = self.store.add("stall/asks", 0)
        if asks > self.answered:
            self.answered = asks
            state = {"ask": asks, "groups": flight.group_progress(), "stack": main_stack(), "time": time.time()}
            self.store.set(f"stall/state/{self.rank}", json.dumps(state))

    def ask_for_dumps(self, error, wait):
        """This rank's call failed: have every other rank dump its flight recorder too, so the
        report can say what the missing ones last did; with ``wait``, wait (briefly) for the
        living ones. Asked once; a second call only waits."""
        try:
            if not self.dumps_asked:
                self.dumps_asked = self.store.add("flight/asks", 1)
                self.dumps_done = max(self.dumps_done, self.dumps_asked)
            wanted = self.dumps_asked
            if not wait:
                return
            # A timeout's ranks are alive but stuck: their dumps are the ones wanted. A peer
            # error's ranks died or broke their connection: they cannot answer.
            dead = set() if type(error).__name__ == "CommTimeout" else set(getattr(error, "ranks", ()))
            others = [r for r in range(self.world_size) if r != self.rank and r not in dead]
            deadline = time.time() + ANSWER_WAIT_S
            while others and time.time() < deadline:
                for peer in list(others):
                    key = f"flight/dumped/{peer}"
                    if self.store.check([key]) and int(self.store.get(key)) >= wanted:
                        others.remove(peer)
                if others:
                    time.sleep(0.05)
        except Exception:   # the store is gone with rank 0: nobody else can be asked
            pass

    # ---- asking ---------------------------------------------------------------------

    def inspect(self):
        ring = flight.RING
        if ring is None:
            return
        now = time.time()
        for r in ring.in_flight():
            started = r["started_s"] or r["queued_s"]
            key = (r["group"], r["seq"], r["op"], r["peer"])
            if now - started < self.stall_s or key in self.reported:
                continue
            self.reported.add(key)
            self.log(self.report(r, now - started))
            return

    def report(self, record, waited):
        """Ask every rank for its state (a counter in the store they watch), gather the
        answers given since, and describe the stall."""
        asks = self.store.add("stall/asks", 1)
        states = {}
        deadline = time.time() + ANSWER_WAIT_S
        others = [r for r in range(self.world_size) if r != self.rank]
        while others and time.time() < deadline:
            for peer in list(others):
                key = f"stall/state/{peer}"
                if self.store.check([key]):
                    state = json.loads(self.store.get(key))
                    if state.get("ask", 0) >= asks:
                        states[peer] = state
                        others.remove(peer)
            if others:
                time.sleep(0.05)
        return describe(self.rank, record, waited, states, others)


def main_stack():
    """The main thread's stack, from the user's script on (the launcher's bootstrap and
    runpy frames above it left out)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return ""
    frames = traceback.extract_stack(frame)
    while len(frames) > 1 and (frames[0].filename.startswith("<frozen") or
                               frames[0].filename.endswith(("launch/bootstrap.py", "runpy.py"))):
        frames.pop(0)
    return "".join(traceback.format_list(frames))


def missing_ranks(record, states):
    """The ranks a stuck call waits for: those whose calls in its group fall short of its
    sequence id (a collective), or its sender (a receive)."""
    if record["peer"] is not None:
        return [record["peer"]]
    return sorted(peer for peer, s in states.items()
                  if record["group"] in s["groups"] and s["groups"][record["group"]] < record["seq"])


def describe(rank, record, waited, states, silent):
    what = f"{record['op']}" + (f" with rank {record['peer']}" if record["peer"] is not None else "")
    lines = [f"paratrain: stall: rank {rank} has waited {waited:.1f}s in {what} "
             f"(group {record['group']}, call #{record['seq']})"]
    missing = missing_ranks(record, states)
    if missing:
        lines.append(f"  waiting for ranks {missing}, which have not made this call yet" if record["peer"] is None
                     else f"  waiting for rank {missing[0]} to send")
        for peer in missing:
            if peer in states:
                lines.append(f"  rank {peer} is at:\n" + indent(states[peer]["stack"].rstrip(), "    "))
    else:
        lines.append("  every rank that answered has made this call; the data is still moving")
    if silent:
        lines.append(f"  ranks {silent} did not answer within {ANSWER_WAIT_S:g}s (dead, or stuck holding the GIL)")
    lines.append("  (it goes on waiting until PARATRAIN_TIMEOUT)")
    return "\n".join(lines)


def indent(text, prefix):
    return "\n".join(prefix + line for line in text.splitlines())
