"""Gradient buckets: many small gradients packed into a few large flat tensors.

Why buckets (Li et al., "PyTorch Distributed: Experiences on Accelerating Data
Parallel Training", VLDB 2020, arXiv 2006.15704, section 3.2.3): one all-reduce
per parameter pays the per-call latency hundreds of times; one all-reduce of
everything after backward cannot overlap with backward. Buckets of ~25 MB are
the middle road: a bucket is reduced as soon as all its gradients exist,
while backward goes on computing the rest.

Parameters go into buckets in *reverse* registration order, because backward
produces gradients roughly from the last layer to the first (DDP does the same,
section 4.2.2), and the first bucket is kept small so that communication starts
early. Each bucket holds one dtype. Its flat tensor comes from
``group.empty_shared`` (shared memory on the shm backend, so its all-reduce
needs no copy-in), and each parameter's ``.grad`` becomes a view into it
(DDP's ``gradient_as_bucket_view``): backward accumulates straight into the
bucket and the averaged result is the gradient, with no copy either way.
"""

FIRST_BUCKET_BYTES = 1 << 20


class Bucket:
    """One flat tensor and the parameters whose gradients are views into it."""

    def __init__(self, index, params, flat):
        self.index = index
        self.params = params
        self.flat = flat
        self.views = []
        off = 0
        for p in params:
            n = p.numel()
            self.views.append(flat[off:off + n].view(p.shape))
            off += n
        self.pending = len(params)

    def adopt_grad(self, i):
        """Make params[i].grad the bucket's view, keeping what it holds: a gradient
        that autograd created elsewhere (after ``zero_grad(set_to_none=True)``) is
        copied in, a missing one becomes zeros."""
        p, view = self.params[i], self.views[i]
        g = p.grad
        if g is None:
            view.zero_()
        elif g.data_ptr() != view.data_ptr():
            view.copy_(g)
        else:
            return
        p.grad = view

    def nbytes(self):
        return self.flat.numel() * self.flat.element_size()


def assign(params, bucket_bytes, first_bucket_bytes=FIRST_BUCKET_BYTES):
    """Lists of parameters, one per bucket, in the order backward should fill them."""
    buckets, current, size, dtype = [], [], 0, None
    cap = min(first_bucket_bytes, bucket_bytes)
    for p in reversed(list(params)):
        nbytes = p.numel() * p.element_size()
        if current and (p.dtype != dtype or size + nbytes > cap):
            buckets.append(current)
            current, size, cap = [], 0, bucket_bytes
        current.append(p)
        size += nbytes
        dtype = p.dtype
    if current:
        buckets.append(current)
    return buckets


def build(group, params, bucket_bytes):
    """Buckets with their flat tensors allocated (collective: every rank calls it alike)."""
    out = []
    for i, ps in enumerate(assign(params, bucket_bytes)):
        flat = group.empty_shared(sum(p.numel() for p in ps), ps[0].dtype)
        flat.zero_()
        b = Bucket(i, ps, flat)
        for j in range(len(ps)):
            b.adopt_grad(j)
        out.append(b)
    return out
