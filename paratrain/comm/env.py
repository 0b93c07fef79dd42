"""Who am I? Reading the environment that launchers leave behind.

``paratrain run`` and torchrun set RANK, WORLD_SIZE, LOCAL_RANK, ... ;
mpirun (Open MPI) sets OMPI_COMM_WORLD_*; SLURM's srun sets SLURM_PROCID and
friends. pt.init() accepts any of them, in that order, so existing cluster
launchers work unchanged. With none set, the process is a world of one.
"""
import os
import socket
from dataclasses import dataclass

from .. import config


@dataclass
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str  # which launcher the values came from


def _int(env, key, default=None):
    v = env.get(key)
    if v is None or v == "":
        if default is None:
            raise ValueError(f"environment variable {key} is not set")
        return default
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"environment variable {key}={v!r} is not an integer") from None


def read_env(env=None):
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        source = "torchrun/paratrain"
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local_rank = _int(env, "LOCAL_RANK", rank)
        local_world = _int(env, "LOCAL_WORLD_SIZE", world)
    elif "OMPI_COMM_WORLD_RANK" in env:
        source = "openmpi"
        rank, world = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
        local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", rank)
        local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", world)
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        source = "slurm"
        rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
        local_rank = _int(env, "SLURM_LOCALID", rank)
        nodes = max(1, _int(env, "SLURM_NNODES", 1))
        local_world = _int(env, "SLURM_NTASKS_PER_NODE", world // nodes) if \
            env.get("SLURM_NTASKS_PER_NODE", "").isdigit() else world // nodes
    else:
        source = "single"
        rank, world, local_rank, local_world = 0, 1, 0, 1
    if world < 1:
        raise ValueError(f"world size {world} (from {source} environment) must be at least 1")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside the world of {world} ranks (from {source} environment)")
    addr = env.get("MASTER_ADDR") or env.get("SLURM_LAUNCH_NODE_IPADDR") or "127.0.0.1"
    port = _int(env, "MASTER_PORT", 29500)
    return LaunchEnv(rank, world, local_rank, local_world, addr, port, source)


def host_id():
    """What identifies this machine: its hostname plus the kernel boot id
    (two containers on one host share memory only if they share both)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def pretend_hosts():
    """PARATRAIN_PRETEND_HOSTS=k splits the ranks into k contiguous "hosts", so the
    cross-host (hierarchical) path can be tested on one machine."""
    return config.get("PARATRAIN_PRETEND_HOSTS")


size_bytes = config.size_bytes   # "4K" -> 4096: one parser for the settings and the benchmarks' --sizes
