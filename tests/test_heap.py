"""launch/heap.py: workers paratrain launches keep big freed blocks in the heap.

The reference is glibc's own bookkeeping (``mallinfo2``: bytes in blocks it
serves by mmap), read by a script started through the bootstrap as a worker
is, with the setting on, off, and overridden by the user's MALLOC_* variable.
"""
import ctypes
import os
import subprocess
import sys
import textwrap

import pytest

from paratrain.launch.local import BOOTSTRAP

pytestmark = pytest.mark.timeout(60)

try:
    ctypes.CDLL(None).mallinfo2
except AttributeError:   # not glibc >= 2.33
    pytest.skip("needs glibc's mallinfo2", allow_module_level=True)

# A 40 MiB block (above glibc's largest dynamic mmap threshold, 32 MiB) taken and
# freed twice: how many bytes were served by mmap while it was held?
SCRIPT = textwrap.dedent("""
    import ctypes
    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                     "fordblks", "keepcost")]
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = Info
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    for _ in range(2):
        before = libc.mallinfo2().hblkhd
        p = libc.malloc(40 << 20)
        mapped = libc.mallinfo2().hblkhd - before
        libc.free(p)
    print(mapped >= 40 << 20)
""")


def mmapped_40mib(tmp_path, **env):
    path = tmp_path / "probe.py"
    path.write_text(SCRIPT)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    environ.pop("PARATRAIN_KEEP_FREED_MEMORY", None)
    out = subprocess.run([sys.executable, "-m", BOOTSTRAP, str(path)], env={**environ, **env},
                         capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip() == "True"


def test_plain_python_maps_a_big_block(tmp_path):
    """The premise: without the setting, glibc gives a 40 MiB block its own mmap."""
    path = tmp_path / "probe.py"
    path.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=50)
    assert out.stdout.strip() == "True", out.stderr


def test_a_launched_worker_serves_it_from_the_heap(tmp_path):
    assert not mmapped_40mib(tmp_path)


def test_the_setting_turns_it_off(tmp_path):
    assert mmapped_40mib(tmp_path, PARATRAIN_KEEP_FREED_MEMORY="0")


def test_the_users_own_malloc_variable_wins(tmp_path):
    """A user who set glibc's threshold (here 1 MiB) keeps it: nothing is changed."""
    assert mmapped_40mib(tmp_path, MALLOC_MMAP_THRESHOLD_=str(1 << 20))
