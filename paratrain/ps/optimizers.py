"""Server-side optimizers: each one updates one shard in place and keeps that
shard's optimizer state beside it.

A shard is a flat float32 numpy array (elements [lo, hi) of one parameter). The
state (momentum, accumulators) stays on the server that owns the shard, so
workers push only gradients and pull only weights, and S servers split the
optimizer's memory S ways (Li et al., "Scaling Distributed Machine Learning with
the Parameter Server", OSDI 2014, sec. 3: the server nodes "maintain a globally
shared parameter" and apply the updates; the same saving ZeRO-1 gets by
sharding the optimizer state, Rajbhandari et al., SC 2020).

    opt = make_optimizer("adam", lr=1e-3)
    opt.step(shard, grad)                         # dense: in place on shard
    opt.step(shard, grad_sum, grad_scale=1 / W)   # BSP: the average, folded into the update
    opt.step_rows(shard.reshape(R, D), rows, g)   # sparse: only the given rows

Numerics are those of torch.optim in torch 2.x on CPU (the single-tensor path,
in float32), so a parameter-server run with one worker follows the same
trajectory as the plain torch optimizer, to float32 rounding:
- SGD: the first step's momentum buffer is the gradient itself, not
  (1 - dampening) * grad (torch/optim/sgd.py, ``buf = grad.detach().clone()``);
  there is no dampening here, so a zero buffer gives the same first step.
- Adagrad: ``clr = lr / (1 + (step - 1) * lr_decay)`` with step counted from 1.
- Adam: bias corrections ``1 - beta ** step`` with step counted from 1, and eps
  added *after* dividing sqrt(v) by sqrt(1 - beta2 ** step) (Kingma & Ba, ICLR
  2015, Algorithm 1), weight decay as L2 added to the gradient (not AdamW).
Row updates (``step_rows``) follow torch's sparse paths instead; see each one.

Dense steps run torch's kernels on torch views of the numpy shards (no copy):
torch fuses what numpy needs a pass and a temporary for (``add_(g, alpha=)``,
``addcmul_``, ``addcdiv_``), and a BSP server's update is the part of every
step that no worker overlaps. Row steps stay in numpy: they index rows first,
which makes copies anyway.
"""
import inspect
import math
import warnings

import numpy as np
import torch

F32 = np.float32


def _flat_param(param, grad):
    """Check a dense step's arguments; the gradient is never written to (the
    server's gradient is often a read-only view of a received buffer)."""
    if not isinstance(param, np.ndarray) or param.dtype != F32 or param.ndim != 1:
        raise ValueError(f"a shard is a flat float32 numpy array, not {type(param).__name__} "
                         f"{getattr(param, 'dtype', '')} of shape {getattr(param, 'shape', '?')}")
    grad = np.asarray(grad, dtype=F32)
    if grad.shape != param.shape:
        raise ValueError(f"gradient of shape {grad.shape} for a shard of shape {param.shape}")
    return grad


def _tensor(a):
    """A torch view of a numpy array, sharing its memory. A received buffer is
    read-only; the optimizers only read gradients, so torch's warning about
    writing through such a view does not apply and is silenced."""
    if a.flags.writeable:
        return torch.from_numpy(a)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def _dense(param, grad, grad_scale, weight_decay):
    """Torch views of a dense step's shard and gradient, and the scale still to apply
    to the gradient. Weight decay needs the scaled gradient itself (g * s + wd * p),
    so then the scale is applied here, in the one temporary the decay needs anyway."""
    g = _flat_param(param, grad)
    p, g = _tensor(param), _tensor(g)
    if weight_decay:
        g = g.mul(grad_scale).add_(p, alpha=weight_decay)
        grad_scale = 1.0
    return p, g, float(grad_scale)


def _row_args(param2d, rows, grad_rows):
    """Check a row step's arguments. Rows must be unique: the update is not
    linear in the gradient, so two gradients for one row must be summed by the
    caller first (torch coalesces a sparse gradient for the same reason)."""
    if not isinstance(param2d, np.ndarray) or param2d.dtype != F32 or param2d.ndim != 2:
        raise ValueError(f"step_rows needs a (R, D) float32 view of the shard, not "
                         f"{getattr(param2d, 'dtype', type(param2d).__name__)} of shape {getattr(param2d, 'shape', '?')}")
    rows = np.asarray(rows)
    if rows.ndim != 1 or not (rows.size == 0 or np.issubdtype(rows.dtype, np.integer)):
        raise ValueError(f"rows must be a 1-d array of integer row indices, not {rows.dtype} of shape {rows.shape}")
    rows = rows.astype(np.int64, copy=False)
    grad_rows = np.asarray(grad_rows, dtype=F32)
    if grad_rows.shape != (rows.size, param2d.shape[1]):
        raise ValueError(f"grad_rows of shape {grad_rows.shape} for {rows.size} rows of width {param2d.shape[1]}")
    if rows.size:
        if rows.min() < 0 or rows.max() >= param2d.shape[0]:
            raise ValueError(f"row indices must lie in [0, {param2d.shape[0]}), got [{rows.min()}, {rows.max()}]")
        if np.unique(rows).size != rows.size:
            raise ValueError("rows must be unique: sum the gradients of a repeated row before the step")
    return rows, grad_rows


class _ShardOptimizer:
    """What the three optimizers share: hyper-parameters and a step count that
    ``state_dict`` saves, and per-element state arrays allocated on the first
    step at the size of the shard (so one optimizer serves exactly one shard)."""

    name = None
    HYPER = ()       # constructor arguments, in order; saved in state_dict
    ARRAYS = ()      # names of the per-element state arrays

    def __init__(self):
        self.steps = 0          # updates applied (dense or row); Adam/Adagrad's `step`
        self.state = {}         # array name -> flat float32 array of the shard's size
        self._root = None       # _square_root's buffer, reused from step to step

    def _fresh(self, name, size):
        return np.zeros(size, dtype=F32)

    def _square_root(self, array):
        """A torch view of sqrt(``array``) in a buffer this optimizer reuses (a fresh one
        would fault its pages in at each step), taken by numpy: torch's CPU kernel takes a
        slow path on exact zeros, and Adam's v and Adagrad's sum stay zero at every entry
        a compressed push has not yet reached."""
        if self._root is None or self._root.size != array.size:
            self._root = np.empty(array.size, dtype=F32)
        return _tensor(np.sqrt(array, out=self._root))

    @property
    def lookahead(self):
        """The momentum coefficient mu (0 without momentum): Nesterov's method takes the
        gradient mu updates ahead of the weights, and so does the servers' weight
        prediction (shard.py)."""
        return 0.0

    def _arrays(self, size):
        """The state arrays for a shard of ``size`` elements, allocated on first use."""
        for name in self.ARRAYS:
            a = self.state.get(name)
            if a is None:
                self.state[name] = self._fresh(name, size)
            elif a.size != size:
                raise ValueError(f"this {self.name} optimizer holds state for a shard of {a.size} elements, "
                                 f"not {size}: use one optimizer per shard")
        return [self.state[name] for name in self.ARRAYS]

    def step_lr_scaled(self, param, grad, lr_scale, rows=None):
        """One step (or row step, with ``rows``) with the learning rate times
        ``lr_scale``. The asynchronous modes apply each of W workers' pushes this
        way with lr_scale = 1/W: scaling the *gradient* instead would change nothing
        for Adam or Adagrad, which divide the scale out, and W full steps per clock
        would take W times BSP's step. For SGD both are the same update."""
        lr = self.lr
        self.lr = lr * lr_scale
        try:
            if rows is None:
                self.step(param, grad)
            else:
                self.step_rows(param, rows, grad)
        finally:
            self.lr = lr

    def resize(self, size):
        """Grow the state arrays to ``size`` elements, the new tail fresh (a sparse
        table's arena grows as rows are created; rows.py). No-op before the first step."""
        for name, a in self.state.items():
            if a.size < size:
                grown = self._fresh(name, size)
                grown[:a.size] = a
                self.state[name] = grown

    def _row_arrays(self, param2d):
        return [a.reshape(param2d.shape) for a in self._arrays(param2d.size)]

    def _begin_rows(self, param2d, rows, grad_rows):
        """What every step_rows starts with: check the rows, count the step (once per
        call, even with no rows, as torch's sparse optimizers do), and add weight decay
        for the touched rows. Returns (rows, their weights, their gradient), or None
        when no row is touched."""
        rows, g = _row_args(param2d, rows, grad_rows)
        self.steps += 1
        if rows.size == 0:
            return None
        p = param2d[rows]
        if self.weight_decay:
            g = g + F32(self.weight_decay) * p
        return rows, p, g

    def hyper(self):
        return {k: getattr(self, k) for k in self.HYPER}

    def state_dict(self):
        """name, hyper-parameters, ``step`` and copies of the state arrays (only
        numbers and numpy arrays, so the server can checkpoint it as raw bytes)."""
        d = {"name": self.name, "step": self.steps}
        for k, v in self.hyper().items():
            if k == "betas":  # Adam's: kept flat, as two numbers
                d["beta1"], d["beta2"] = v
            else:
                d[k] = v
        d.update({k: a.copy() for k, a in self.state.items()})
        return d

    def load_state_dict(self, d):
        """Restore what ``state_dict`` returned; the hyper-parameters too, as
        torch's ``load_state_dict`` restores its param_groups."""
        if d.get("name") != self.name:
            raise ValueError(f"state of a {d.get('name')!r} optimizer cannot be loaded into {self.name!r}")
        hyper = {}
        for k in self.HYPER:
            if k == "betas":
                hyper[k] = (d["beta1"], d["beta2"])
            elif k in d:
                hyper[k] = d[k]
            else:
                raise ValueError(f"{self.name} state_dict lacks {k!r}")
        fresh = type(self)(**hyper)   # validates the hyper-parameters
        for k in self.HYPER:
            setattr(self, k, getattr(fresh, k))
        self.steps = int(d.get("step", 0))
        sizes = {np.asarray(d[k]).size for k in self.ARRAYS if k in d}
        if len(sizes) > 1:
            raise ValueError(f"{self.name} state arrays of different sizes {sorted(sizes)}")
        self.state = {k: np.array(d[k], dtype=F32).reshape(-1) for k in self.ARRAYS if k in d}


class SGD(_ShardOptimizer):
    """Stochastic gradient descent with momentum (Polyak 1964; Nesterov's form as
    in Sutskever et al., ICML 2013), written as torch.optim.SGD with dampening 0:
        g <- grad + wd * p;  buf <- g on the first step, else m * buf + g
        d <- g + m * buf (nesterov) or buf;  p <- p - lr * d
    """

    name = "sgd"
    HYPER = ("lr", "momentum", "weight_decay", "nesterov")
    ARRAYS = ("momentum_buffer",)

    def __init__(self, lr, momentum=0.0, weight_decay=0.0, nesterov=False):
        super().__init__()
        self.lr, self.momentum, self.weight_decay = float(lr), float(momentum), float(weight_decay)
        self.nesterov = bool(nesterov)
        if self.lr < 0 or self.momentum < 0 or self.weight_decay < 0:
            raise ValueError(f"sgd needs lr, momentum, weight_decay >= 0, got {self.lr}, {self.momentum}, "
                             f"{self.weight_decay}")
        if self.nesterov and self.momentum <= 0:
            raise ValueError("sgd: nesterov momentum requires momentum > 0")

    @property
    def lookahead(self):
        return self.momentum

    def _direction(self, g, buf, first):
        m = F32(self.momentum)
        if first:
            buf[...] = g        # torch: buf = grad.clone() on the first step
        else:
            buf *= m
            buf += g
        return g + m * buf if self.nesterov else buf

    def step(self, param, grad, grad_scale=1.0):
        """One step on ``grad * grad_scale``, as torch.optim.SGD's single-tensor path:
        buf <- m * buf + g (g itself on the first step); p <- p - lr * d."""
        p, g, s = _dense(param, grad, grad_scale, self.weight_decay)
        self.steps += 1
        if not self.momentum:
            p.add_(g, alpha=-self.lr * s)
            return
        first = "momentum_buffer" not in self.state
        buf = _tensor(self._arrays(param.size)[0])
        if first:
            torch.mul(g, s, out=buf)
        else:
            buf.mul_(self.momentum).add_(g, alpha=s)
        if self.nesterov:
            p.add_(g, alpha=-self.lr * s).add_(buf, alpha=-self.lr * self.momentum)
        else:
            p.add_(buf, alpha=-self.lr)

    def step_rows(self, param2d, rows, grad_rows):
        """Update only ``rows``. Without momentum this equals a dense step whose
        gradient is zero on the other rows. With momentum it is *lazy*: only the
        touched rows' buffers move, where a dense step would also decay the
        others' (buf <- m * buf) and keep moving their weights by lr * m * buf.
        A row's buffer starts at zero, which gives buf = g on its first touch,
        the same as torch's first step. Weight decay, too, reaches only the
        touched rows."""
        begun = self._begin_rows(param2d, rows, grad_rows)
        if begun is None:
            return
        rows, p, g = begun
        if self.momentum:
            buf2d, = self._row_arrays(param2d)
            buf = buf2d[rows]
            g = self._direction(g, buf, first=False)
            buf2d[rows] = buf
        param2d[rows] = p - F32(self.lr) * g


class Adagrad(_ShardOptimizer):
    """Adagrad (Duchi, Hazan and Singer, JMLR 2011), written as torch.optim.Adagrad:
        g <- grad + wd * p;  sum <- sum + g * g
        clr = lr / (1 + (step - 1) * lr_decay);  p <- p - clr * g / (sqrt(sum) + eps)
    """

    name = "adagrad"
    HYPER = ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps")
    ARRAYS = ("sum",)

    def __init__(self, lr, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10):
        super().__init__()
        self.lr, self.lr_decay, self.weight_decay = float(lr), float(lr_decay), float(weight_decay)
        self.initial_accumulator_value, self.eps = float(initial_accumulator_value), float(eps)
        if min(self.lr, self.lr_decay, self.weight_decay, self.initial_accumulator_value, self.eps) < 0:
            raise ValueError(f"adagrad needs every hyper-parameter >= 0, got {self.hyper()}")

    def _fresh(self, name, size):
        return np.full(size, self.initial_accumulator_value, dtype=F32)

    def _clr(self):
        return self.lr / (1 + (self.steps - 1) * self.lr_decay)

    def step(self, param, grad, grad_scale=1.0):
        """One step on ``grad * grad_scale``, as torch.optim.Adagrad's single-tensor path,
        the square root of the sum numpy's (_square_root)."""
        p, g, s = _dense(param, grad, grad_scale, self.weight_decay)
        summed = self._arrays(param.size)[0]
        self.steps += 1
        _tensor(summed).addcmul_(g, g, value=s * s)
        std = self._square_root(summed).add_(self.eps)
        p.addcdiv_(g, std, value=-self._clr() * s)

    def step_rows(self, param2d, rows, grad_rows):
        """Update only ``rows``, as torch.optim.Adagrad does for a sparse gradient:
        the step count (hence clr) advances once per call; the other rows' sums
        and weights stay as they are. torch refuses weight decay with a sparse
        gradient; here it is applied to the touched rows only."""
        total2d, = self._row_arrays(param2d)
        begun = self._begin_rows(param2d, rows, grad_rows)
        if begun is None:
            return
        rows, p, g = begun
        total = total2d[rows] + g * g
        total2d[rows] = total
        param2d[rows] = p + F32(-self._clr()) * (g / (np.sqrt(total) + F32(self.eps)))


class Adam(_ShardOptimizer):
    """Adam (Kingma and Ba, ICLR 2015), written as torch.optim.Adam (not AdamW):
        g <- grad + wd * p;  m <- lerp(m, g, 1 - b1);  v <- b2 * v + (1 - b2) * g * g
        p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    """

    name = "adam"
    HYPER = ("lr", "betas", "eps", "weight_decay")
    ARRAYS = ("exp_avg", "exp_avg_sq")

    def __init__(self, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__()
        try:
            b1, b2 = betas
        except (TypeError, ValueError):
            raise ValueError(f"adam: betas must be two numbers, got {betas!r}") from None
        self.lr, self.betas = float(lr), (float(b1), float(b2))
        self.eps, self.weight_decay = float(eps), float(weight_decay)
        if not (0 <= self.betas[0] < 1 and 0 <= self.betas[1] < 1):
            raise ValueError(f"adam needs 0 <= beta < 1, got betas {self.betas}")
        if min(self.lr, self.eps, self.weight_decay) < 0:
            raise ValueError(f"adam needs lr, eps, weight_decay >= 0, got {self.lr}, {self.eps}, {self.weight_decay}")

    @property
    def lookahead(self):
        return self.betas[0]

    def step(self, param, grad, grad_scale=1.0):
        """One step on ``grad * grad_scale``, as torch.optim.Adam's single-tensor path
        (with the scale, m <- b1 m + (1 - b1) s g instead of lerp: the same to rounding),
        the square root of v numpy's (_square_root)."""
        p, g, s = _dense(param, grad, grad_scale, self.weight_decay)
        moments = self._arrays(param.size)
        m, v = (_tensor(a) for a in moments)
        self.steps += 1
        b1, b2 = self.betas
        if s == 1.0:
            m.lerp_(g, 1 - b1)
        else:
            m.mul_(b1).add_(g, alpha=(1 - b1) * s)
        v.mul_(b2).addcmul_(g, g, value=(1 - b2) * s * s)
        step_size = self.lr / (1 - b1 ** self.steps)
        denom = self._square_root(moments[1]).div_((1 - b2 ** self.steps) ** 0.5).add_(self.eps)
        p.addcdiv_(m, denom, value=-step_size)

    def step_rows(self, param2d, rows, grad_rows):
        """Lazy Adam on ``rows``, as torch.optim.SparseAdam: only the touched rows'
        moments move (an untouched row's m and v do not decay), and the step count
        t in the bias corrections is the optimizer's, advanced once per call even
        when ``rows`` is empty -- SparseAdam keeps one step per parameter, not
        one per row. So the server must call step_rows on a shard for every
        update (empty rows included) to follow SparseAdam on the whole table.
        SparseAdam also places eps differently from dense Adam:
            p <- p - lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)
        (torch/optim/_functional.py, sparse_adam), i.e. dense Adam's eps times
        sqrt(1 - b2^t); we follow it. SparseAdam has no weight decay; here it is
        L2 on the touched rows only."""
        m2d, v2d = self._row_arrays(param2d)
        begun = self._begin_rows(param2d, rows, grad_rows)
        if begun is None:
            return
        rows, p, g = begun
        b1, b2 = self.betas
        m_old, v_old = m2d[rows], v2d[rows]
        m = (g - m_old) * F32(1 - b1) + m_old
        v = (g * g - v_old) * F32(1 - b2) + v_old
        m2d[rows], v2d[rows] = m, v
        step_size = self.lr * math.sqrt(1 - b2 ** self.steps) / (1 - b1 ** self.steps)
        param2d[rows] = p + F32(-step_size) * (m / (np.sqrt(v) + F32(self.eps)))


OPTIMIZERS = {"sgd": SGD, "adagrad": Adagrad, "adam": Adam}


def make_optimizer(name, **hyper):
    """The optimizer ``name`` (sgd, adagrad, adam) with its hyper-parameters, as a
    worker names them in ``register(model, optimizer=..., lr=...)``. Errors name
    the valid choices, since they travel back to a worker as text."""
    cls = OPTIMIZERS.get(str(name).lower())
    if cls is None:
        raise ValueError(f"unknown optimizer {name!r}: choose one of {', '.join(OPTIMIZERS)}")
    params = inspect.signature(cls).parameters
    unknown = sorted(set(hyper) - set(params))
    if unknown:
        raise ValueError(f"{cls.name} has no hyper-parameter {', '.join(unknown)}; "
                         f"its hyper-parameters are {', '.join(params)}")
    missing = [k for k, p in params.items() if p.default is p.empty and k not in hyper]
    if missing:
        raise ValueError(f"{cls.name} needs {', '.join(missing)} (its hyper-parameters are {', '.join(params)})")
    return cls(**hyper)
