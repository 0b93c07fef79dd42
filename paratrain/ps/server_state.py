"""A server's checkpoint: its shards, sparse rows, optimizer state and clocks, in
one file, written atomically, read back without unpickling anything.

    save(server, path)        # periodically, and when the server stops cleanly
    load(server, path)        # a restarted server, before it serves again
    Checkpoints(directory, index, seconds, clocks)   # where and when one server saves

The file is an ``.npz`` (numpy's zip of raw arrays), loaded with
``allow_pickle=False``; the scalars (mode, clocks, hyper-parameters, which
array is which) travel as a JSON document stored in it as bytes. It is written
to a temporary name and renamed over the old one (``os.replace``), so a server
killed mid-write leaves the previous checkpoint whole.

What is lost when a server dies: every update it applied after its last
checkpoint, and a BSP round it was gathering (ps-lite's servers recover the
same way, from a snapshot plus whatever the workers push next: Li et al.,
OSDI 2014, sec. 4.3, there with replication to lose nothing, which we do not
do).
"""
import io
import json
import os
import time
import zipfile

import numpy as np

VERSION = 1


def checkpoint_path(directory, index):
    return os.path.join(directory, f"server-{index}.npz")


class Checkpoints:
    """Where and when one server saves: in ``directory`` (None: never), every
    ``seconds`` or every ``clocks`` clocks of the slowest worker (0: not by that
    rule), checked from the server's loop between requests."""

    def __init__(self, directory, index, seconds=30.0, clocks=0):
        self.path = checkpoint_path(directory, index) if directory else None
        self.seconds, self.clocks = seconds, clocks
        self.last_save, self.saved_clock = time.monotonic(), 0

    def save(self, server):
        if self.path and server.clocks is not None:
            save(server, self.path)
            self.last_save, self.saved_clock = time.monotonic(), server.clocks.min_clock()

    def maybe_save(self, server):
        if not self.path or server.clocks is None:
            return
        if (self.clocks and server.clocks.min_clock() >= self.saved_clock + self.clocks) or \
                (self.seconds and time.monotonic() - self.last_save >= self.seconds):
            self.save(server)

    def restore(self, server):
        """Load the checkpoint into ``server`` if there is one; returns its meta or None."""
        if not self.path or not os.path.exists(self.path):
            return None
        meta = load(server, self.path)
        self.saved_clock = server.clocks.min_clock()
        return meta


def save(server, path):
    """Write ``server``'s state to ``path`` atomically. Returns the bytes written."""
    arrays = {}
    meta = {"version": VERSION, "index": server.index, "servers": server.servers, "mode": server.mode,
            "workers": server.workers, "staleness": server.staleness, "optimizer": server.optimizer,
            "hyper": server.hyper, "clocks": server.clocks.state(), "shards": [], "tables": [],
            "predict": server.predict}
    for i, shard in enumerate(server.shards.values()):
        arrays[f"shard{i}.value"] = shard.value
        opt = shard.opt.state_dict()
        for k, v in opt.items():
            if isinstance(v, np.ndarray):
                arrays[f"shard{i}.opt.{k}"] = v
        meta["shards"].append({"key": shard.key, "lo": shard.lo, "hi": shard.hi, "applied": shard.applied,
                               "opt": {k: v for k, v in opt.items() if not isinstance(v, np.ndarray)}})
    for key, table in server.tables.items():
        t_arrays, t_meta = table.state()
        arrays.update({f"table{key}.{k}": v for k, v in t_arrays.items()})
        meta["tables"].append(dict(t_meta, key=key, spec=server.table_specs[key]))
    arrays["meta.json"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return os.path.getsize(path)


def read(path):
    """(meta dict, arrays dict) from a checkpoint file, with a clear error when it is
    not one of ours or is damaged."""
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        meta = json.loads(arrays.pop("meta.json").tobytes().decode())
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, io.UnsupportedOperation) as e:
        raise ValueError(f"{path} is not a readable parameter-server checkpoint ({type(e).__name__}: {e}); "
                         "move it away to start the server empty") from None
    if meta.get("version") != VERSION:
        raise ValueError(f"{path} is a version {meta.get('version')} checkpoint; this paratrain reads {VERSION}")
    return meta, arrays


def load(server, path):
    """Restore ``server`` (freshly made, nothing registered) from ``path``."""
    meta, arrays = read(path)
    if meta["index"] != server.index:
        raise ValueError(f"{path} belongs to server {meta['index']}, not server {server.index}")
    server.initialise({"workers": meta["workers"], "mode": meta["mode"], "staleness": meta["staleness"],
                       "optimizer": meta["optimizer"], "hyper": meta["hyper"], "servers": meta["servers"],
                       "predict": meta.get("predict", False),
                       "tables": [t["spec"] for t in sorted(meta["tables"], key=lambda t: t["key"])]},
                      [(s["key"], s["lo"], s["hi"]) for s in meta["shards"]],
                      np.concatenate([arrays[f"shard{i}.value"] for i in range(len(meta["shards"]))])
                      if meta["shards"] else np.zeros(0, np.float32), quiet=True)
    for i, s in enumerate(meta["shards"]):
        shard = server.shards[(s["key"], s["lo"])]
        prefix = f"shard{i}.opt."
        shard.opt.load_state_dict(dict(s["opt"], **{k[len(prefix):]: v for k, v in arrays.items()
                                                    if k.startswith(prefix)}))
        shard.applied = int(s["applied"])
    if server.fused is not None:   # the loaded state into the one buffer the fused step uses
        server.fused.link()
    for t in meta["tables"]:
        prefix = f"table{t['key']}."
        server.tables[t["key"]].load({k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}, t)
    server.clocks.load(meta["clocks"])
    return meta
