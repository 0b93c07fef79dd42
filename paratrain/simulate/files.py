"""CLUSTER.toml and WORKLOAD.toml: what ``paratrain simulate`` predicts for, and on what.

    # CLUSTER.toml                      # WORKLOAD.toml
    name = "128 x 4 P100, RoCE"         name = "ResNet-101"
    nodes = 128                         params = 44_500_000
    devices_per_node = 4                bytes_per_param = 4        # fp32 gradients
    intra_node_gbps = 80                batch_per_device = 64
    intra_node_latency_us = 5           step_compute_ms = 490      # forward + backward, one device
    inter_node_gbps = 25                backward_fraction = 0.667  # optional (2/3)
    inter_node_latency_us = 10          weight_fraction = 0.5  # optional: W's share of backward
                                        split_cost = 1.0       # optional: B then W against whole
                                        # optional, for pipeline and tensor parallelism,
    reduce_gbps = 1000     # optional   # ZeRO-3's units and PowerSGD:
    encode_gbps = 2000     # optional   layers = 24
                                        hidden = 1024
                                        seq_len = 512
                                        activation_bytes = 16_777_216  # one layer's output, one batch
                                        encode_ms = 9   # optional: compressing a step's gradients
                                        server_update_ms = 40   # optional: the servers' optimizer

``reduce_gbps`` is gamma (reductions; default free), ``encode_gbps`` the rate
compression streams through gradients (default reduce_gbps, else the
intra-node rate). The keys are fixed (users' files depend on them); more keys are allowed and
ignored. A missing or ill-typed key is an error that names the file and key.
"""
import dataclasses
import tomllib

from .collectives import Link
from .system import Cluster, Workload

REQUIRED = object()


def _read(path):
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path} is not valid TOML: {e}") from None


def _get(data, path, key, kind, positive=True, default=REQUIRED):
    if key not in data:
        if default is not REQUIRED:
            return default
        raise ValueError(f"{path}: missing key {key!r}")
    value = data[key]
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float else \
        isinstance(value, int) and not isinstance(value, bool)
    if not ok or (positive and not value > 0):
        raise ValueError(f"{path}: {key} = {value!r}; give a positive {'number' if kind is float else 'whole number'}")
    return kind(value)


def load_cluster(path):
    data = _read(path)
    reduce_gbps = _get(data, path, "reduce_gbps", float, default=0.0) or None
    links = [Link.from_rates(_get(data, path, f"{where}_node_gbps", float),
                             _get(data, path, f"{where}_node_latency_us", float), reduce_gbps)
             for where in ("intra", "inter")]
    return Cluster(str(data.get("name", path)), _get(data, path, "nodes", int),
                   _get(data, path, "devices_per_node", int), *links,
                   _get(data, path, "encode_gbps", float, default=None))


def _fraction(data, path, key, default, of):
    fraction = _get(data, path, key, float, default=default)
    if not 0 < fraction < 1:
        raise ValueError(f"{path}: {key} = {fraction!r}; give a share of the {of}, between 0 and 1")
    return fraction


def _fractions(data, path):
    """{backward_fraction, weight_fraction, split_cost} the file gives."""
    given = {key: _fraction(data, path, key, None, of) for key, of in
             (("backward_fraction", "step"), ("weight_fraction", "backward")) if key in data}
    if "split_cost" in data:
        given["split_cost"] = _get(data, path, "split_cost", float)
    return given


def load_workload(path):
    """A WORKLOAD.toml, or a built-in model's name (``gpt``), whose step is then measured
    here (here.py), as is a file's ``model = "gpt"`` (its other keys then override)."""
    from . import here
    from ..train.tasks import TASKS
    if str(path) in TASKS:
        return here.workload_of(str(path))
    data = _read(path)
    if "model" in data:
        measured = here.workload_of(data["model"], _get(data, path, "batch_per_device", int, default=None))
        keys = {"name": str, "params": int, "bytes_per_param": float, "layers": int,
                "hidden": int, "seq_len": int, "activation_bytes": float}
        changes = {k: (str(data[k]) if kind is str else _get(data, path, k, kind)) for k, kind in keys.items()
                   if k in data}
        changes.update(_fractions(data, path))
        for key in ("step_compute_ms", "step_jitter_ms", "encode_ms", "server_update_ms"):
            if key in data:
                changes[key.replace("_ms", "_s")] = _get(data, path, key, float) / 1e3
        return dataclasses.replace(measured, **changes)
    return Workload(str(data.get("name", path)), _get(data, path, "params", int),
                    _get(data, path, "bytes_per_param", float), _get(data, path, "batch_per_device", int),
                    _get(data, path, "step_compute_ms", float) / 1e3,
                    layers=_get(data, path, "layers", int, default=None),
                    hidden=_get(data, path, "hidden", int, default=None),
                    seq_len=_get(data, path, "seq_len", int, default=None),
                    activation_bytes=_get(data, path, "activation_bytes", float, default=None),
                    step_jitter_s=_get(data, path, "step_jitter_ms", float, default=0.0) / 1e3,
                    encode_s=_seconds(data, path, "encode_ms"),
                    server_update_s=_seconds(data, path, "server_update_ms"), **_fractions(data, path))


def _seconds(data, path, key):
    """An optional ``*_ms`` key in seconds, None when absent: ``encode_ms``, a device's
    compression of a step's gradients (top-k, PowerSGD; absent, compressed.py's formula);
    ``server_update_ms``, the parameter servers' optimizer step over every parameter
    (absent, the gradients' summing stands for it)."""
    ms = _get(data, path, key, float, default=None)
    return None if ms is None else ms / 1e3
