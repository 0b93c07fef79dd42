"""Keep freed memory in the process's heap, so a training step (or a parameter
server's update) reuses it instead of asking the kernel for fresh pages every time.

Why: glibc's malloc serves every block above ``M_MMAP_THRESHOLD`` with its own
``mmap`` and gives it back with ``munmap`` when freed. Its dynamic threshold
stops growing at 32 MiB on 64-bit machines, and a layer's gradient or weight
is often bigger (a 3072 x 3072 float32 Linear weight is 36 MiB). So every
backward pass maps fresh memory for each such gradient, and the kernel faults
in and zeroes every 4 KiB page of it, on the training thread, at every step,
for memory the step needs again at once. Smaller blocks have the same fate
when the free space at the top of the heap grows past ``M_TRIM_THRESHOLD``
and is given back. A parameter server's update allocates a few shard-sized
temporaries (the BSP average, lr x direction), and pays the same way.

What we set (``mallopt``, the documented knobs; the same as the environment
variables ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_``):
blocks up to 2 GiB come from the heap, and up to 2 GiB of free memory at its
top is kept. The price is a resident size that stays at the step's peak
instead of breathing with it, what a training loop reaches again at every
step anyway (PyTorch's CUDA caching allocator makes the same trade on GPUs).

Applied by the bootstrap (bootstrap.py) to every worker paratrain launches,
before the script runs, and by every parameter server as it starts
(ps/server.py), unless ``PARATRAIN_KEEP_FREED_MEMORY=0`` or the user set
either glibc variable (theirs win). Not on a C library other than glibc.
"""
import ctypes
import os

M_TRIM_THRESHOLD = -1       # from glibc's <malloc.h>
M_MMAP_THRESHOLD = -3
KEEP_BYTES = (1 << 31) - 1  # mallopt takes an int: 2 GiB - 1
USER_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def keep_freed_memory():
    """Apply the settings above; returns True if glibc took them, False if not
    glibc, turned off, or the user's own MALLOC_* variables are in force."""
    from .. import config
    if not config.get("PARATRAIN_KEEP_FREED_MEMORY") or any(os.environ.get(v) for v in USER_VARIABLES):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False   # not glibc (musl, macOS): nothing to tune the same way
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, KEEP_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, KEEP_BYTES))
