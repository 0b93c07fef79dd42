"""CLUSTER.toml and WORKLOAD.toml: what ``paratrain simulate`` predicts for, and on what.

    # CLUSTER.toml                      # WORKLOAD.toml
    name = "128 x 4 P100, RoCE"         name = "ResNet-101"
    nodes = 128                         params = 44_500_000
    devices_per_node = 4                bytes_per_param = 4        # fp32 gradients
    intra_node_gbps = 80                batch_per_device = 64
    intra_node_latency_us = 5           step_compute_ms = 490      # forward + backward, one device
    inter_node_gbps = 25                backward_fraction = 0.667  # optional (2/3)
    inter_node_latency_us = 10
    reduce_gbps = 1000                  # optional (gamma)

The keys are fixed (users' files depend on them); more keys are allowed and
ignored. A missing or ill-typed key is an error that names the file and key.
"""
import tomllib
from dataclasses import dataclass

from .collectives import Link


@dataclass(frozen=True)
class Cluster:
    name: str
    nodes: int
    devices_per_node: int
    intra: Link
    inter: Link

    @property
    def devices(self):
        return self.nodes * self.devices_per_node


@dataclass(frozen=True)
class Workload:
    name: str
    params: int
    bytes_per_param: float
    batch_per_device: int
    step_compute_s: float
    backward_fraction: float = 2 / 3

    @property
    def gradient_bytes(self):
        return self.params * self.bytes_per_param


def _read(path):
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path} is not valid TOML: {e}") from None


def _get(data, path, key, kind, positive=True, default=None):
    if key not in data:
        if default is not None:
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
                   _get(data, path, "devices_per_node", int), *links)


def load_workload(path):
    data = _read(path)
    fraction = _get(data, path, "backward_fraction", float, default=2 / 3)
    if not 0 < fraction < 1:
        raise ValueError(f"{path}: backward_fraction = {fraction!r}; give a share of the step, between 0 and 1")
    return Workload(str(data.get("name", path)), _get(data, path, "params", int),
                    _get(data, path, "bytes_per_param", float), _get(data, path, "batch_per_device", int),
                    _get(data, path, "step_compute_ms", float) / 1e3, fraction)
