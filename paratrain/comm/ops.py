"""Reduce ops and dtypes: how paratrain names them and how it computes them.

Buffers travel as numpy arrays of the element's raw type. numpy has no
bfloat16, so a bfloat16 buffer is a ``uint16`` array of the same bits; its
reductions, and float16's (numpy emulates float16, many times slower than
torch's vectorised kernels), run in torch on zero-copy views of the same memory.
"""
import ctypes
import warnings

import numpy as np
import torch

REDUCE_OPS = ("sum", "avg", "max", "min", "prod")
_OP_SET = frozenset(REDUCE_OPS)

# code on the wire / in descriptors, torch dtype, numpy storage dtype
_DTYPES = [
    (1, torch.float16, np.float16),
    (2, torch.bfloat16, np.uint16),
    (3, torch.float32, np.float32),
    (4, torch.float64, np.float64),
    (5, torch.int32, np.int32),
    (6, torch.int64, np.int64),
    (7, torch.uint8, np.uint8),
]
DTYPE_CODE = {t: c for c, t, _ in _DTYPES}
CODE_TORCH = {c: t for c, t, _ in _DTYPES}
CODE_NUMPY = {c: n for c, _, n in _DTYPES}
NUMPY_CODE = {np.dtype(n): c for c, t, n in _DTYPES if t is not torch.bfloat16}
_HALF_CODES = {1, 2}
_INT_CODES = {5, 6, 7}
BFLOAT16, INT64, UINT8 = 2, 6, 7
CODE_ITEMSIZE = {c: np.dtype(n).itemsize for c, _, n in _DTYPES}


def itemsize(code):
    """Bytes per element of a dtype code."""
    return CODE_ITEMSIZE[code]


REDUCE_CODE = {name: i + 1 for i, name in enumerate(REDUCE_OPS)}


def normalize_op(op):
    """Accept "sum", torch.distributed.ReduceOp.SUM (an enum value) and
    torch.distributed.ReduceOp(ReduceOp.SUM) (an instance, which keeps its enum in ``.op``)."""
    if isinstance(op, str) and op in _OP_SET:
        return op
    op = getattr(op, "op", op)
    name = getattr(op, "name", None) or str(op)
    name = name.rsplit(".", 1)[-1].lower()
    name = {"average": "avg", "product": "prod"}.get(name, name)
    if name not in REDUCE_OPS:
        raise ValueError(f"unknown reduce op {op!r}; use one of {', '.join(REDUCE_OPS)}")
    return name


def check_op_dtype(op, code):
    if op == "avg" and code in _INT_CODES:
        raise ValueError(
            f"op='avg' on {CODE_TORCH[code]} is ambiguous (integer division); "
            "all_reduce with op='sum' and divide as you need")


def torch_view(a, code):
    """A torch tensor sharing the numpy buffer's memory (bfloat16 reinterpreted from uint16).
    A read-only array (what a send sends) is only read: torch's warning that its
    tensor could write to it is silenced."""
    if a.flags.writeable:
        t = torch.from_numpy(a)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(a)
    return t.view(torch.bfloat16) if code == 2 else t


_NP_FUNCS = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}
_TORCH_FUNCS = {"sum": torch.add, "avg": torch.add, "max": torch.maximum, "min": torch.minimum, "prod": torch.mul}


def combine(out, a, b, op, code):
    """out = a (op) b, elementwise, in the buffers' own dtype. out may alias a or b."""
    if code in _HALF_CODES:
        _TORCH_FUNCS[op](torch_view(a, code), torch_view(b, code), out=torch_view(out, code))
    else:
        _NP_FUNCS[op](a, b, out=out)


# Copies between these sizes go through a ufunc; below, the call overhead of a plain
# assignment is lowest; above, glibc's memcpy switches to non-temporal stores and wins.
COPY_UFUNC_MIN = 32 * 1024
COPY_UFUNC_MAX = 512 * 1024


def copy(dst, src):
    """dst[...] = src for two equal-length contiguous flat buffers, at memory speed at every size.

    A plain numpy assignment is glibc's memcpy, which for mid-size copies (tens
    of KiB to a few hundred KiB) takes the ``rep movsb`` path; on the AMD EPYC
    machines we run on, that path copies out of a small reused buffer (exactly
    what a pipelined collective does) several times slower than numpy's
    vectorised ``positive`` loop over the same bytes viewed as uint8
    (benchmarks/memcpy.py). From 1 MiB up memcpy is as fast or faster.
    Not torch's copy_: it may fan out to intra-op threads and oversubscribe the
    cores the other ranks need.
    """
    if COPY_UFUNC_MIN <= dst.nbytes < COPY_UFUNC_MAX:
        copy_vectorised(dst, src)
    else:
        dst[...] = src


def copy_vectorised(dst, src):
    """dst[...] = src with numpy's vectorised ``positive`` loop over the bytes, not
    memcpy: for copy()'s mid-size chunks (above), and for a one-shot copy of buffers
    too large to still be in cache (cma.all_gather's own piece of a multi-MiB
    input). glibc's memcpy takes ``rep movsb`` for the latter too, which on the AMD EPYC
    machines we run on copies out of memory slower than plain vector loads and
    stores, while at 1 MiB or with both buffers in cache the two tie
    (benchmarks/memcpy.py)."""
    np.positive(src.view(np.uint8), out=dst.view(np.uint8))


def finish_avg(buf, world_size, code):
    """Turn a sum into the mean (floating dtypes only; see check_op_dtype).

    For a power-of-two world size, multiplying by 1/P gives the same bits as
    dividing by P (both are the exactly scaled value, correctly rounded), and a
    vector multiply has a higher throughput than a vector divide on CPUs."""
    scale = 1.0 / world_size if world_size & (world_size - 1) == 0 else None
    if code in _HALF_CODES:
        t = torch_view(buf, code)
        t.mul_(scale) if scale is not None else t.div_(world_size)
    elif scale is not None:
        np.multiply(buf, scale, out=buf)
    else:
        np.divide(buf, world_size, out=buf)


def as_buffer(tensor, what="tensor", writable=True):
    """A flat numpy view of a CPU torch tensor or numpy array, sharing its memory.

    Returns (flat_view, dtype_code). Non-contiguous or non-CPU input is refused
    rather than silently copied, since collectives write their result in place;
    a read-only numpy array too, unless ``writable`` is False (a buffer the call
    only reads: what a send sends, a collective's separate input).

    It runs at the start of every collective, usually just after the previous
    call's copies flushed the caches, where each Python-level step costs many
    times more than hot (a cache and TLB miss per object touched). So the common
    cases take the fewest steps: numpy tested first and by exact type
    (``isinstance(x, torch.Tensor)`` goes through torch's metaclass, slow cold),
    a torch tensor's checks folded into one ``.numpy()`` (which refuses GPU,
    grad-requiring and bfloat16 tensors; those take the full path, which says
    what was wrong), the flags object built once, a 1-D array returned as it is
    rather than reshaped.
    """
    if type(tensor) is np.ndarray:
        return _numpy_buffer(tensor, what, writable)
    if type(tensor) is torch.Tensor:
        try:
            a = tensor.numpy()
        except (TypeError, RuntimeError):
            return _torch_buffer(tensor, what)
        code = NUMPY_CODE.get(a.dtype)
        if code is None or not a.flags.c_contiguous:
            return _torch_buffer(tensor, what)
        return (a if a.ndim == 1 else a.reshape(-1)), code
    if isinstance(tensor, torch.Tensor):
        return _torch_buffer(tensor, what)
    if isinstance(tensor, np.ndarray):
        return _numpy_buffer(tensor, what, writable)
    raise TypeError(f"{what} must be a CPU torch.Tensor or numpy.ndarray, not {type(tensor).__name__}")


def tensor_code(tensor, what, cpu=True):
    """The dtype code of a torch tensor a collective takes, after the checks every
    backend makes: a supported dtype, contiguous (results are written in place, so
    nothing is silently copied), and, unless ``cpu`` is False (the torch backend
    hands tensors to torch.distributed as they are), on the CPU."""
    code = DTYPE_CODE.get(tensor.dtype)
    if code is None:
        raise TypeError(f"{what} has dtype {tensor.dtype}; supported: {supported_dtypes()}")
    if cpu and not tensor.is_cpu:
        raise ValueError(f"{what} is on {tensor.device}; this backend takes CPU tensors: copy to the CPU with "
                         ".cpu(), or use pt.init(backend='nccl') (or 'torch'), which hands tensors to "
                         "torch.distributed as they are")
    if not tensor.is_contiguous():
        raise ValueError(f"{what} is not contiguous; call .contiguous() first")
    return code


def _torch_buffer(tensor, what):
    code = tensor_code(tensor, what)
    t = tensor.detach() if tensor.requires_grad else tensor
    if code == 2:
        return t.view(torch.int16).numpy().view(np.uint16).reshape(-1), code
    return t.numpy().reshape(-1), code


def _numpy_buffer(a, what, writable):
    code = NUMPY_CODE.get(a.dtype)
    if code is None:
        raise TypeError(f"{what} has numpy dtype {a.dtype}; supported: {supported_dtypes()}")
    flags = a.flags
    if not flags.c_contiguous:
        raise ValueError(f"{what} is not C-contiguous; use np.ascontiguousarray first")
    if writable and not flags.writeable:
        raise ValueError(f"{what} is read-only, and this call writes its result into it")
    return (a if a.ndim == 1 else a.reshape(-1)), code


def address(a):
    """Where a contiguous array's first byte is. Through the buffer protocol in C,
    cheaper cold or hot than ``a.ctypes.data`` (which builds a Python helper
    object) or ``__array_interface__`` (a dict). The buffer protocol refuses
    read-only and empty arrays: those take ctypes.data."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))
    except (TypeError, ValueError):
        return a.ctypes.data


def span(pieces):
    """One flat view over ``pieces`` (flat arrays of one dtype) lying end to end in
    memory, as the views of one tensor that all_gather_into_tensor passes do, so an
    engine can move them in one call; None if they do not. Writing the view writes
    exactly the pieces' bytes."""
    first, total = pieces[0], sum(p.size for p in pieces)
    if total == 0:
        return np.empty(0, first.dtype)
    if not end_to_end(pieces):
        return None
    return np.lib.stride_tricks.as_strided(first, shape=(total,), strides=(first.itemsize,))


def end_to_end(pieces):
    """Does each piece start where the one before it ends?"""
    at = address(pieces[0])
    for p in pieces:
        if address(p) != at:
            return False
        at += p.nbytes
    return True


def overlaps(a, pieces):
    """Does array ``a`` share any byte with any of ``pieces``? An in-place
    reduce_scatter passes its output as a view of its own input piece (as ZeRO and
    FSDP do with NCCL), and a reduction writing there before it has read the
    piece would count it twice."""
    lo = address(a)
    hi = lo + a.nbytes
    for p in pieces:
        at = address(p)
        if at < hi and lo < at + p.nbytes:
            return True
    return False


def supported_dtypes():
    return ", ".join(str(t).replace("torch.", "") for _, t, _ in _DTYPES)
