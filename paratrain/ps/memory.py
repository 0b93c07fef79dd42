"""Memory tuning for the server process (a libc call through ctypes)."""

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3   # glibc's mallopt parameters (malloc.h)


def keep_freed_memory(limit=1 << 30):
    """Ask glibc to keep freed memory in the process instead of handing it back.

    Every update allocates a few shard-sized numpy temporaries (the BSP average,
    lr x direction). glibc serves blocks of more than 128 KiB with a fresh mmap,
    or trims the heap top once it is free, so each update page-faults its
    temporaries in again; in the VMs we run on a fault costs microseconds, and a
    1.6 MB push measured 2.9 ms on the server instead of 0.8 ms. mallopt
    (a plain libc call, through ctypes) raises both thresholds. Returns True
    when glibc accepted."""
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_TRIM_THRESHOLD, limit)) and bool(libc.mallopt(M_MMAP_THRESHOLD, limit))
    except (OSError, AttributeError):   # not glibc: nothing to tune
        return False
