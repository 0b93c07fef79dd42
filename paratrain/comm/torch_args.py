"""The torch tensors a TorchGroup hands to torch.distributed: checked and shaped.

The torch backend passes the caller's own tensors through (torch_backend.py),
so the checks ProcessGroup makes on flat numpy buffers (ops.as_buffer,
ProcessGroup._gathered) are made here on the tensors themselves, with the same
rules and the same errors: a supported dtype, contiguous, world_size pieces of
the right size. One difference is kept out of the caller's way: paratrain asks
pieces only for their number of elements, where Gloo's gathering collectives
want their shapes to match, so pieces go to the engine flat (views of the same
memory, never copies).
"""
import torch

from . import ops


def tensor_arg(tensor, what="tensor"):
    """(the tensor to hand to torch.distributed, its dtype code): the caller's own
    (detached if it requires grad, as ops.as_buffer detaches), on any device."""
    code = ops.tensor_code(tensor, what, cpu=False)
    return (tensor.detach() if tensor.requires_grad else tensor), code


def flat(t):
    """t itself if 1-D, else a flat view of it (the same memory)."""
    return t if t.dim() == 1 else t.view(-1)


def all_tensors(*args):
    """Are all the arguments, or all the items of list arguments, torch tensors?"""
    items = [x for a in args for x in (a if isinstance(a, (list, tuple)) else [a])]
    return all(isinstance(x, torch.Tensor) for x in items)


def pieces_like(x, like, P, what):
    """``x`` as ProcessGroup._gathered takes it: a list of P tensors of like's dtype
    and size, or one tensor of P x like.numel() elements. Returns the list, each
    flat, or the one tensor, flat (torch's own single form)."""
    n = like.numel()
    if isinstance(x, (list, tuple)):
        if len(x) != P:
            raise ValueError(f"{what} has {len(x)} tensors; it needs one per rank ({P})")
        pieces = [tensor_arg(p, f"{what}[{i}]")[0] for i, p in enumerate(x)]
        for i, p in enumerate(pieces):
            if p.numel() != n:
                raise ValueError(f"{what}[{i}] has {p.numel()} elements, expected {n}")
            if p.dtype != like.dtype:
                raise TypeError(f"{what} dtype differs from the tensor's ({p.dtype} vs {like.dtype})")
        return [flat(p) for p in pieces]
    t, _ = tensor_arg(x, what)
    if t.numel() != n * P:
        raise ValueError(f"{what} has {t.numel()} elements; it needs world_size x {n} = {n * P}")
    if t.dtype != like.dtype:
        raise TypeError(f"{what} dtype differs from the tensor's ({t.dtype} vs {like.dtype})")
    return flat(t)


def split_arg(x, P, what):
    """all_to_all's argument: (a list of P flat tensors, or one tensor whose number
    of elements P divides; its dtype code)."""
    if isinstance(x, (list, tuple)):
        if len(x) != P:
            raise ValueError(f"{what} has {len(x)} tensors; it needs one per rank ({P})")
        pieces = [tensor_arg(p, f"{what}[{i}]") for i, p in enumerate(x)]
        codes = {c for _, c in pieces}
        if len(codes) > 1:
            raise TypeError(f"{what} mixes dtypes")
        return [flat(p) for p, _ in pieces], codes.pop()
    t, code = tensor_arg(x, what)
    if t.numel() % P:
        raise ValueError(f"{what} has {t.numel()} elements, not divisible by world size {P}"
                         + ("; pass lists for uneven pieces" if what.endswith("input") else ""))
    return t, code


def even_pieces(x, P):
    """A list of P flat tensors as it is; one flat tensor cut into P equal views."""
    if isinstance(x, list):
        return x
    n = x.numel() // P
    return [x[i * n:(i + 1) * n] for i in range(P)]


def overlap(a, b):
    """Do two flat tensors share a byte of memory?"""
    if a.device != b.device or not a.numel() or not b.numel():
        return False
    return a.data_ptr() < b.data_ptr() + b.nbytes and b.data_ptr() < a.data_ptr() + a.nbytes
