"""Values between neighbouring stages: activations forward, their gradients back.

What crosses a cut is a tuple of values: tensors, and the odd Python int,
float, bool, None or tuple of ints (a shape) that fx carries between
operations. Nothing is pickled. Each bundle of activations is preceded by a
fixed-size int64 header saying, per value, its kind, dtype and shape (an int
or a float travels inside the header itself), so the receiver allocates
exactly what comes and a stage follows shapes that change from one
micro-batch to the next (a shorter sequence): the price is one small message
per bundle (2.8 KB, small beside the activations). Tensors follow, one
message each, in their own dtype, straight from their memory.

A gradient bundle needs no header: it holds, in order, one gradient for each
floating-point tensor of the activations it answers, with their shapes and
dtypes, which both sides know.

Tags keep the streams apart: activations into stage s and gradients out of
stage s use their own tag ranges, and within one (peer, tag) messages arrive
in the order they were sent (MPI's non-overtaking rule, which every paratrain
backend keeps), which is the order every schedule consumes them in.
"""
import struct

import torch

from ...comm import ops

MAX_VALUES = 32          # values crossing one cut
MAX_DIMS = 8
FIELDS = 3 + MAX_DIMS    # kind, dtype code, ndim, dims
HEADER = 1 + MAX_VALUES * FIELDS
TENSOR, INT, FLOAT, BOOL, SHAPE, NONE = range(6)
BOOL_CODE = 100          # a bool tensor travels as uint8
CODE_DTYPE = dict(ops.CODE_TORCH)
CODE_DTYPE[BOOL_CODE] = torch.bool
ACTIVATION, GRADIENT = 0, 1


def tag(stage, direction, index):
    """Header (index 0) and values (1..) of activations into ``stage`` or gradients out of it."""
    return (stage * 2 + direction) * (MAX_VALUES + 1) + index


def tied_tag(total, index):
    """The ``index``-th weight that several of ``total`` stages share (tied.py): tags
    past those of every stage and of the forward's output (``Pipeline.forward``)."""
    return tag(total + 1, ACTIVATION, 0) + index


def _describe(values, where):
    if len(values) > MAX_VALUES:
        raise ValueError(f"{where}: {len(values)} values cross this cut, at most {MAX_VALUES}; "
                         "cut somewhere fewer values are alive")
    head = torch.zeros(HEADER, dtype=torch.int64)
    head[0] = len(values)
    tensors = []
    for i, v in enumerate(values):
        row = head[1 + i * FIELDS: 1 + (i + 1) * FIELDS]
        if torch.is_tensor(v):
            code = BOOL_CODE if v.dtype == torch.bool else ops.DTYPE_CODE.get(v.dtype)
            if code is None:
                raise TypeError(f"{where}: value {i} is a {v.dtype} tensor, which cannot cross a cut; "
                                f"supported: {', '.join(str(d).replace('torch.', '') for d in CODE_DTYPE.values())}")
            if v.dim() > MAX_DIMS:
                raise ValueError(f"{where}: value {i} has {v.dim()} dimensions, at most {MAX_DIMS}")
            row[0], row[1], row[2] = TENSOR, code, v.dim()
            row[3:3 + v.dim()] = torch.tensor(v.shape, dtype=torch.int64)
            tensors.append(v)
        elif isinstance(v, bool):
            row[0], row[3] = BOOL, int(v)
        elif isinstance(v, int):
            row[0], row[3] = INT, v
        elif isinstance(v, float):
            row[0], row[3] = FLOAT, struct.unpack("<q", struct.pack("<d", v))[0]
        elif v is None:
            row[0] = NONE
        elif isinstance(v, (tuple, list, torch.Size)) and all(isinstance(x, int) for x in v) and len(v) <= MAX_DIMS:
            row[0], row[2] = SHAPE, len(v)
            row[3:3 + len(v)] = torch.tensor(list(v), dtype=torch.int64)
        else:
            raise TypeError(f"{where}: value {i} is a {type(v).__name__}, which cannot cross a cut (tensors, "
                            "ints, floats, bools, None and tuples of ints can); cut where only those are alive")
    return head, tensors


def send_activations(group, values, dst, stage, works):
    """Start sending ``values`` to the rank holding ``stage``; the Works go into ``works``."""
    head, tensors = _describe(values, f"sending activations to stage {stage}")
    works.append((group.isend(head, dst, tag(stage, ACTIVATION, 0)), head))
    for i, t in enumerate(tensors):
        t = t.detach().contiguous()
        if t.dtype == torch.bool:
            t = t.view(torch.uint8)
        if t.numel():
            works.append((group.isend(t, dst, tag(stage, ACTIVATION, 1 + i)), t))


def recv_activations(group, src, stage):
    """Receive one bundle of activations for ``stage`` (blocking): the tuple of values."""
    head = torch.empty(HEADER, dtype=torch.int64)
    group.recv(head, src, tag(stage, ACTIVATION, 0))
    n = int(head[0])
    values, k = [], 0
    for i in range(n):
        row = head[1 + i * FIELDS: 1 + (i + 1) * FIELDS].tolist()
        kind = row[0]
        if kind == TENSOR:
            shape = row[3:3 + row[2]]
            code = row[1]
            dtype = CODE_DTYPE.get(code)
            if dtype is None:
                raise ValueError(f"stage {stage}: a corrupt activation header from rank {src} (dtype code {code})")
            t = torch.empty(shape, dtype=torch.uint8 if dtype == torch.bool else dtype)
            if t.numel():
                group.recv(t, src, tag(stage, ACTIVATION, 1 + k))
            k += 1
            values.append(t.view(torch.bool) if dtype == torch.bool else t)
        elif kind == INT:
            values.append(row[3])
        elif kind == BOOL:
            values.append(bool(row[3]))
        elif kind == FLOAT:
            values.append(struct.unpack("<d", struct.pack("<q", row[3]))[0])
        elif kind == NONE:
            values.append(None)
        elif kind == SHAPE:
            values.append(torch.Size(row[3:3 + row[2]]))
        else:
            raise ValueError(f"stage {stage}: a corrupt activation header from rank {src} (kind {kind})")
    return tuple(values)


def differentiable(values):
    """The values a gradient comes back for: floating-point tensors."""
    return [v for v in values if torch.is_tensor(v) and v.is_floating_point()]


def send_gradients(group, grads, dst, stage, works):
    """Start sending the gradients of stage ``stage``'s differentiable inputs to the previous stage."""
    for i, g in enumerate(grads):
        g = g.contiguous()
        if g.numel():
            works.append((group.isend(g, dst, tag(stage, GRADIENT, 1 + i)), g))


def _gradient_buffers(like):
    """Where the gradients of the differentiable values sent (``like``) land, in order."""
    return [torch.empty_like(t, memory_format=torch.contiguous_format) for t in like]


def post_gradients(group, src, stage, like):
    """Start receiving the gradients, from stage ``stage``, of the differentiable values
    sent to it (``like``): (the tensors they land in, the receives' Works)."""
    out = _gradient_buffers(like)
    works = [group.irecv(g, src, tag(stage, GRADIENT, 1 + i)) for i, g in enumerate(out) if g.numel()]
    return out, works


def recv_gradients(group, src, stage, like):
    """The gradients, from stage ``stage``, of the differentiable values sent to it (``like``)."""
    out = _gradient_buffers(like)
    for i, g in enumerate(out):
        if g.numel():
            group.recv(g, src, tag(stage, GRADIENT, 1 + i))
    return out
