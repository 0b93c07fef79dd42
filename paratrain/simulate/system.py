"""The two things a prediction is for: the cluster (its devices and links) and the workload
(the model and one device's step). files.py reads them from TOML; here.py measures them here."""
from dataclasses import dataclass

from .calibrate import oversubscribed
from .collectives import Link
from .step import Unavailable


@dataclass(frozen=True)
class Cluster:
    name: str
    nodes: int
    devices_per_node: int
    intra: Link
    inter: Link
    encode_gbps: float = None    # how fast a device streams through gradients to compress them
    host_algorithms: tuple = ("ring", "tree")   # the all-reduces paratrain chooses from inside a host
    cores: int = None            # cores a host's devices share (this machine's processes), None: one each
    contention: float = 1.0      # k in (P/cores)^k: how ranks sharing cores slow a collective (calibrate.py)
    crowding: object = None      # crowding.Crowding: a synchronization of more ranks than cores, measured here
    crowded: Link = None         # the host's memory as ranks sharing its cores meet it (calibrate.py); None: intra

    def host_link(self, ranks):
        """The host's memory as ``ranks`` processes on it meet it: ``intra`` while each has a
        core; past the cores, ``crowded`` (else ``intra``) slowed by the most crowded core."""
        slow = oversubscribed(ranks, self.cores, self.contention)
        return self.intra if slow == 1 else (self.crowded or self.intra).slowed(slow)

    @property
    def devices(self):
        return self.nodes * self.devices_per_node

    @property
    def encode_beta(self):
        """Seconds per gradient byte of one compression pass: ``encode_gbps``, else the
        reduction rate, else the intra-node rate."""
        if self.encode_gbps:
            return 8 / (self.encode_gbps * 1e9)
        return self.intra.gamma or self.intra.beta


@dataclass(frozen=True)
class Workload:
    name: str
    params: int
    bytes_per_param: float
    batch_per_device: int
    step_compute_s: float
    backward_fraction: float = 2 / 3
    layers: int = None           # repeated blocks: what a pipeline cuts between, ZeRO-3 gathers one by one
    hidden: int = None           # width: the activations' size, and PowerSGD's matrices
    seq_len: int = None          # tokens per sample (1 for an image model's features)
    activation_bytes: float = None   # one layer's output for one device's batch (default batch x seq x hidden x 4)
    step_jitter_s: float = 0.0   # the standard deviation of step_compute_s from step to step (waits.py)
    weight_fraction: float = 1 / 2   # the weight gradients' share of the backward (a zero-bubble pipeline's W)
    split_cost: float = 1.0      # a backward split into B and W against a whole one (pipeline.py)
    encode_s: float = None       # a worker's compression of a step's gradients (None: compressed.py's formula)
    server_update_s: float = None   # parameter servers: the optimizer over every parameter, as a server runs it
    ps_step_s: float = None         # a parameter-server worker's step outside its compute, its server beside it
    stage_send_s: float = None      # a pipeline's micro-batch between two stages on one host, as the engine sends it
    stage_actions: tuple = None     # a pipeline's (F, B, W) a micro-batch, rank by rank, as the engine ran them here

    @property
    def gradient_bytes(self):
        return self.params * self.bytes_per_param

    @property
    def forward_s(self):
        return self.step_compute_s * (1 - self.backward_fraction)

    @property
    def backward_s(self):
        return self.step_compute_s * self.backward_fraction

    def layer_activation_bytes(self, why):
        """One layer's output for one device's batch; ``why`` names the strategy that needs it."""
        if self.activation_bytes:
            return self.activation_bytes
        if self.hidden:
            return self.batch_per_device * (self.seq_len or 1) * self.hidden * 4
        raise Unavailable(f"{why} sends activations: give the workload's activation_bytes, or hidden (and seq_len)")

    def need_layers(self, why):
        if not self.layers:
            raise Unavailable(f"{why} cuts the model between its layers: give the workload's layers")
        return self.layers
