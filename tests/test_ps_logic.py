"""The parameter server's pure logic: the shard optimizers against torch.optim,
and the BSP/ASP/SSP clock rule (Ho et al., NIPS 2013) under random schedules."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from paratrain.ps.consistency import Clocks, effective_mode, valid_staleness
from paratrain.ps.optimizers import SGD, Adagrad, Adam, make_optimizer

torch.set_num_threads(1)

TOL = dict(rtol=1e-5, atol=1e-6)
STEPS = 20

TORCH = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam}
SETTINGS = [
    ("sgd", dict(lr=0.1)),
    ("sgd", dict(lr=0.05, momentum=0.9)),
    ("sgd", dict(lr=0.05, momentum=0.9, nesterov=True)),
    ("sgd", dict(lr=0.1, momentum=0.5, weight_decay=0.01)),
    ("sgd", dict(lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    ("adagrad", dict(lr=0.1)),
    ("adagrad", dict(lr=0.1, lr_decay=0.05)),
    ("adagrad", dict(lr=0.05, weight_decay=0.01, initial_accumulator_value=0.1)),
    ("adagrad", dict(lr=0.1, lr_decay=0.01, eps=1e-3)),
    ("adam", dict(lr=1e-3)),
    ("adam", dict(lr=1e-2, betas=(0.5, 0.9))),
    ("adam", dict(lr=1e-2, betas=(0.3, 0.99), eps=1e-3)),   # beta1 < 0.5: lerp from the other end
    ("adam", dict(lr=1e-3, weight_decay=0.1)),
    ("adam", dict(lr=0.05, betas=(0.0, 0.5), eps=1e-6, weight_decay=0.01)),
]
IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in h.items())}" for n, h in SETTINGS]


def _problem(seed, n=257, steps=STEPS):
    rng = np.random.default_rng(seed)
    p0 = rng.standard_normal(n).astype(np.float32)
    grads = [rng.standard_normal(n).astype(np.float32) * rng.uniform(0.1, 3) for _ in range(steps)]
    return p0, grads


def _torch_trajectory(name, hyper, p0, grads):
    p = torch.nn.Parameter(torch.tensor(p0))
    opt = TORCH[name]([p], foreach=False, **hyper)
    out = []
    for g in grads:
        p.grad = torch.tensor(g)
        opt.step()
        out.append(p.detach().numpy().copy())
    return out


# ---- dense steps against torch.optim -------------------------------------------------------

@pytest.mark.parametrize("name,hyper", SETTINGS, ids=IDS)
def test_step_matches_torch(name, hyper):
    p0, grads = _problem(1)
    want = _torch_trajectory(name, hyper, p0, grads)
    opt = make_optimizer(name, **hyper)
    p = p0.copy()
    for t, g in enumerate(grads):
        g = np.frombuffer(g.tobytes(), dtype=np.float32)   # read-only, as the server receives it
        opt.step(p, g)
        np.testing.assert_allclose(p, want[t], **TOL, err_msg=f"{name} {hyper} step {t + 1}")
    assert opt.steps == STEPS


@pytest.mark.parametrize("name,hyper", SETTINGS, ids=IDS)
def test_lr_scaled_step_is_torch_with_the_smaller_lr(name, hyper):
    """What ASP/SSP apply per push (lr / W): torch's optimizer with lr / 3, and the
    optimizer's own lr unchanged afterwards."""
    p0, grads = _problem(1)
    want = _torch_trajectory(name, dict(hyper, lr=hyper["lr"] / 3), p0, grads)
    opt = make_optimizer(name, **hyper)
    p = p0.copy()
    for t, g in enumerate(grads):
        opt.step_lr_scaled(p, g, 1 / 3)
        np.testing.assert_allclose(p, want[t], **TOL, err_msg=f"{name} {hyper} step {t + 1}")
    assert opt.lr == hyper["lr"]


@pytest.mark.parametrize("name,hyper", SETTINGS, ids=IDS)
def test_state_dict_round_trip(name, hyper):
    p0, grads = _problem(2)
    whole, p = make_optimizer(name, **hyper), p0.copy()
    for g in grads:
        whole.step(p, g)

    first, q = make_optimizer(name, **hyper), p0.copy()
    for g in grads[:10]:
        first.step(q, g)
    sd = first.state_dict()
    assert sd["name"] == name and sd["step"] == 10
    for k, v in sd.items():
        assert k == "name" or isinstance(v, (int, float, bool, np.ndarray)), (k, type(v))
    snapshot = {k: v.copy() for k, v in sd.items() if isinstance(v, np.ndarray)}
    first.step(q.copy(), grads[10])          # the saved state is a copy, not a view of the live one
    for k, v in snapshot.items():
        np.testing.assert_array_equal(sd[k], v)

    other = {"sgd": dict(lr=9.0), "adagrad": dict(lr=9.0), "adam": dict(lr=9.0)}[name]
    second = make_optimizer(name, **other)   # load_state_dict restores the hyper-parameters too
    second.load_state_dict(sd)
    for g in grads[10:]:
        second.step(q, g)
    np.testing.assert_array_equal(q, p)
    assert second.state_dict().keys() == whole.state_dict().keys()


def test_load_state_dict_checks():
    sd = Adam(lr=0.1).state_dict()
    with pytest.raises(ValueError, match="adam"):
        SGD(lr=0.1).load_state_dict(sd)
    with pytest.raises(ValueError, match="lr"):
        Adam(lr=0.1).load_state_dict({"name": "adam", "beta1": 0.9, "beta2": 0.9, "eps": 1e-8,
                                      "weight_decay": 0.0})


# ---- row updates ------------------------------------------------------------------------

R, D = 16, 6


def _row_problem(seed, steps=STEPS, empty_at=(7,), every_step=()):
    """Random row subsets per step (some empty); rows in ``every_step`` are in every
    subset, and the last two rows are never touched."""
    rng = np.random.default_rng(seed)
    p0 = rng.standard_normal((R, D)).astype(np.float32)
    plan = []
    for t in range(steps):
        if t in empty_at:
            rows = np.zeros(0, np.int64)
        else:
            rows = rng.choice(R - 2, size=rng.integers(1, R - 2), replace=False)
            rows = np.union1d(rows, np.asarray(every_step, np.int64)).astype(np.int64)
            rng.shuffle(rows)
        plan.append((rows, rng.standard_normal((rows.size, D)).astype(np.float32)))
    return p0, plan


def _sparse(rows, g):
    return torch.sparse_coo_tensor(torch.tensor(rows).reshape(1, -1), torch.tensor(g).reshape(-1, D), (R, D),
                                   check_invariants=True)


def _dense(rows, g):
    full = np.zeros((R, D), np.float32)
    full[rows] = g
    return torch.tensor(full)


def _run_rows(opt, p0, plan):
    shard = p0.reshape(-1).copy()          # the flat shard; step_rows gets a (R, D) view of it
    out = []
    for rows, g in plan:
        opt.step_rows(shard.reshape(R, D), rows, g)
        out.append(shard.reshape(R, D).copy())
    return out


def _torch_rows(cls, p0, plan, grad, **hyper):
    p = torch.nn.Parameter(torch.tensor(p0))
    opt = cls([p], **hyper)
    out = []
    for rows, g in plan:
        p.grad = grad(rows, g)
        opt.step()
        out.append(p.detach().numpy().copy())
    return out


@pytest.mark.parametrize("hyper", [dict(lr=1e-2), dict(lr=0.05, betas=(0.5, 0.9), eps=1e-3),
                                   dict(lr=0.1, betas=(0.3, 0.99), eps=1e-6)])
def test_adam_rows_match_sparse_adam(hyper):
    p0, plan = _row_problem(3)
    want = _torch_rows(torch.optim.SparseAdam, p0, plan, _sparse, **hyper)
    opt = Adam(**hyper)
    got = _run_rows(opt, p0, plan)
    for t, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_allclose(a, b, **TOL, err_msg=f"step {t + 1}")
    np.testing.assert_array_equal(got[-1][-2:], p0[-2:])                  # never touched: unchanged
    assert not opt.state["exp_avg"].reshape(R, D)[-2:].any()
    assert opt.steps == STEPS                                             # empty calls count, as in SparseAdam


def test_adam_rows_are_lazy_not_dense():
    """A row left out of a step keeps its moments (dense Adam would decay them and
    still move the row)."""
    p0, plan = _row_problem(4, steps=2, empty_at=())
    opt = Adam(lr=0.1)
    shard = p0.copy()
    opt.step_rows(shard, np.array([0, 1]), np.ones((2, D), np.float32))
    m = opt.state["exp_avg"].reshape(R, D)
    before, m1 = shard.copy(), m[1].copy()
    opt.step_rows(shard, np.array([0]), np.ones((1, D), np.float32))
    np.testing.assert_array_equal(shard[1:], before[1:])
    np.testing.assert_array_equal(m[1], m1)


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")   # raised inside torch's Adagrad
def test_adagrad_rows_match_torch_sparse():
    hyper = dict(lr=0.1, lr_decay=0.02, initial_accumulator_value=0.1, eps=1e-6)
    p0, plan = _row_problem(5)
    want = _torch_rows(torch.optim.Adagrad, p0, plan, _sparse, **hyper)
    got = _run_rows(Adagrad(**hyper), p0, plan)
    for t, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_allclose(a, b, **TOL, err_msg=f"step {t + 1}")
    np.testing.assert_array_equal(got[-1][-2:], p0[-2:])


def test_sgd_rows_match_dense_sgd():
    """Plain SGD: a row step is a dense step with zeros elsewhere. Our dense step runs
    torch's kernel (p.add_(g, alpha=-lr)), so it equals torch.optim.SGD bit for bit;
    the row step runs numpy, which rounds lr * g before the sum where torch's
    vectorised kernel fuses the multiply-add, so it agrees up to those two
    roundings. Each step starts from the row step's weights (plain SGD has no
    state), lest the roundings add up."""
    p0, plan = _row_problem(6)
    got = _run_rows(SGD(lr=0.1), p0, plan)
    dense = SGD(lr=0.1)
    p = torch.nn.Parameter(torch.tensor(p0))
    ref = torch.optim.SGD([p], lr=0.1, foreach=False)
    before = p0
    for t, ((rows, g), a) in enumerate(zip(plan, got)):
        flat = before.reshape(-1).copy()
        dense.step(flat, _dense(rows, g).numpy().reshape(-1))
        with torch.no_grad():
            p.copy_(torch.tensor(before))
        p.grad = _dense(rows, g)
        ref.step()
        np.testing.assert_array_equal(flat.reshape(R, D), p.detach().numpy(), err_msg=f"step {t + 1}")
        rounding = np.spacing(np.abs(np.float32(0.1) * p.grad.numpy())) + np.spacing(np.abs(a))
        assert (np.abs(a - flat.reshape(R, D)) <= rounding).all(), f"step {t + 1}"
        untouched = np.setdiff1d(np.arange(R), rows)
        np.testing.assert_array_equal(a[untouched], before[untouched])
        before = a
    np.testing.assert_array_equal(got[-1][-2:], p0[-2:])


def test_sgd_rows_momentum_is_lazy():
    """Rows touched at every step follow dense SGD with momentum; rows touched now
    and then keep their buffer while untouched (dense SGD would decay it)."""
    every = (0, 3)
    p0, plan = _row_problem(7, empty_at=(), every_step=every)
    hyper = dict(lr=0.05, momentum=0.9, nesterov=True)
    want = _torch_rows(torch.optim.SGD, p0, plan, _dense, foreach=False, **hyper)
    opt = SGD(**hyper)
    shard = p0.copy()
    buf = None
    for (rows, g), w in zip(plan, want):
        kept = None if buf is None else buf.copy()
        opt.step_rows(shard, rows, g)
        buf = opt.state["momentum_buffer"].reshape(R, D)
        np.testing.assert_allclose(shard[list(every)], w[list(every)], **TOL)
        if kept is not None:
            others = np.setdiff1d(np.arange(R), rows)
            np.testing.assert_array_equal(buf[others], kept[others])
    np.testing.assert_array_equal(shard[-2:], p0[-2:])


def test_rows_weight_decay_touches_only_given_rows():
    for opt in (SGD(lr=0.1, momentum=0.9, weight_decay=0.5), Adagrad(lr=0.1, weight_decay=0.5),
                Adam(lr=0.1, weight_decay=0.5)):
        p0 = np.ones((R, D), np.float32)
        shard = p0.copy()
        opt.step_rows(shard, np.array([2, 5]), np.zeros((2, D), np.float32))
        assert (shard[[2, 5]] < 1).all(), opt.name
        np.testing.assert_array_equal(np.delete(shard, [2, 5], axis=0), np.delete(p0, [2, 5], axis=0))


def test_row_and_shard_checks():
    opt = Adam(lr=0.1)
    shard = np.zeros((R, D), np.float32)
    with pytest.raises(ValueError, match="unique"):
        opt.step_rows(shard, np.array([1, 1]), np.zeros((2, D), np.float32))
    with pytest.raises(ValueError, match=r"\[0, 16\)"):
        opt.step_rows(shard, np.array([16]), np.zeros((1, D), np.float32))
    with pytest.raises(ValueError, match=r"\[0, 16\)"):
        opt.step_rows(shard, np.array([-1]), np.zeros((1, D), np.float32))
    with pytest.raises(ValueError, match="grad_rows"):
        opt.step_rows(shard, np.array([1]), np.zeros((1, D + 1), np.float32))
    with pytest.raises(ValueError, match="integer"):
        opt.step_rows(shard, np.array([1.0]), np.zeros((1, D), np.float32))
    opt.step(np.zeros(R * D, np.float32), np.ones(R * D, np.float32))
    with pytest.raises(ValueError, match="one optimizer per shard"):
        opt.step(np.zeros(7, np.float32), np.ones(7, np.float32))
    with pytest.raises(ValueError, match="gradient"):
        SGD(lr=0.1).step(np.zeros(4, np.float32), np.ones(5, np.float32))
    with pytest.raises(ValueError, match="float32"):
        SGD(lr=0.1).step(np.zeros(4, np.float64), np.ones(4, np.float32))


# ---- make_optimizer ------------------------------------------------------------------------

def test_make_optimizer_errors():
    with pytest.raises(ValueError, match="sgd, adagrad, adam"):
        make_optimizer("rmsprop", lr=0.1)
    with pytest.raises(ValueError, match=r"momentum.*lr, betas, eps, weight_decay"):
        make_optimizer("adam", lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=r"needs lr"):
        make_optimizer("sgd")
    for name, bad in [("sgd", dict(lr=-1)), ("sgd", dict(lr=0.1, nesterov=True)),
                      ("adagrad", dict(lr=0.1, lr_decay=-1)), ("adam", dict(lr=0.1, betas=(1.0, 0.9))),
                      ("adam", dict(lr=0.1, betas=(0.9,)))]:
        with pytest.raises(ValueError):
            make_optimizer(name, **bad)
    assert isinstance(make_optimizer("Adam", lr=0.1, betas=[0.8, 0.9]), Adam)   # msgpack sends lists


# ---- the clock rule -------------------------------------------------------------------------

def _simulate(clocks, targets, choices):
    """Run workers to ``targets[w]`` steps each; at every turn one runnable worker
    (chosen by ``choices``: random speeds) pulls, computes, pushes and clocks.
    Checks the SSP rule and guarantee at every read; returns the lags read."""
    W, s = clocks.workers, clocks.staleness
    applied = set()            # (worker, clock) updates on the server: pushed before the clock
    lags = []
    choices = iter(choices)
    for w in range(W):
        if targets[w] == 0:
            clocks.finish(w)
    while clocks.active():
        active = clocks.active()
        cs = [clocks.clock_of(w) for w in active]
        runnable = [w for w in active if clocks.may_read(w)]
        for w in active:
            assert (w in runnable) == (not clocks.blocking_workers(w))
            for b in clocks.blocking_workers(w):
                assert clocks.clock_of(b) < clocks.clock_of(w) - s and b in active
        if max(cs) - min(cs) <= s:
            assert runnable == active          # within s of each other: nobody waits
        assert runnable                        # the slowest can always go: no deadlock
        w = runnable[next(choices, 0) % len(runnable)]
        c = clocks.clock_of(w)
        assert c - clocks.min_clock() <= s
        for v in range(W):                     # sees every update from clocks < c - s
            for t in range(min(c - s, clocks.clock_of(v)) if s != math.inf else 0):
                assert (v, t) in applied
        lags.append(clocks.record_read(w))
        applied.add((w, c))                    # push, then clock
        assert clocks.advance(w) == c + 1
        if c + 1 == targets[w]:
            clocks.finish(w)
    assert [clocks.clock_of(w) for w in range(W)] == list(targets)
    assert sum(clocks.histogram().values()) == len(lags) == sum(targets)
    assert clocks.histogram() == {k: lags.count(k) for k in sorted(set(lags))}
    return lags


schedules = dict(targets=st.lists(st.integers(0, 8), min_size=1, max_size=5),
                 choices=st.lists(st.integers(0, 10 ** 6), max_size=60))


@settings(max_examples=150, deadline=None)
@given(s=st.integers(0, 4), **schedules)
def test_ssp_bounds_staleness(s, targets, choices):
    lags = _simulate(Clocks(len(targets), "ssp", s), targets, choices)
    assert all(0 <= lag <= s for lag in lags)


@settings(max_examples=60, deadline=None)
@given(**schedules)
def test_bsp_reads_only_at_the_slowest_clock(targets, choices):
    lags = _simulate(Clocks(len(targets), "bsp"), targets, choices)
    assert set(lags) <= {0}


@settings(max_examples=60, deadline=None)
@given(**schedules)
def test_asp_never_blocks(targets, choices):
    c = Clocks(len(targets), "asp")
    assert c.staleness == math.inf
    _simulate(c, targets, choices)
    c2 = Clocks(3, "asp")
    for _ in range(50):
        c2.advance(0)
    assert c2.may_read(0) and c2.blocking_workers(0) == []


def test_blocking_workers_names_the_slow_ones():
    c = Clocks(4, "ssp", 1)
    for w, n in enumerate([5, 3, 4, 2]):
        for _ in range(n):
            c.advance(w)
    assert c.blocking_workers(0) == [1, 3] and not c.may_read(0)
    assert c.blocking_workers(2) == [3] and c.blocking_workers(3) == [] and c.may_read(3)
    assert c.min_clock() == 2 and c.clock_of(1) == 3
    assert list(c.log)[:2] == [(0, 1), (0, 2)] and len(c.log) == 14


def test_finish_releases_the_others():
    c = Clocks(3, "ssp", 1)
    for _ in range(3):
        c.advance(0)
    c.advance(1)
    assert c.blocking_workers(0) == [1, 2]
    c.finish(2)
    assert c.blocking_workers(0) == [1] and c.min_clock() == 1
    c.advance(1)
    assert c.may_read(0)
    c.finish(2)                                    # twice: harmless
    with pytest.raises(ValueError, match="finished"):
        c.advance(2)
    c.finish(0)
    c.finish(1)
    assert c.min_clock() == 3 and c.may_read(1)    # nobody left to wait for


def test_histogram_and_record_read():
    c = Clocks(2, "ssp", 3)
    assert c.record_read(0) == 0
    c.advance(0)
    c.advance(0)
    assert c.record_read(0) == 2 and c.record_read(1) == 0 and c.record_read(0) == 2
    assert c.histogram() == {0: 2, 2: 2}


def test_aggregate_ready():
    c = Clocks(3, "bsp")
    assert not c.aggregate_ready(0, set())
    assert not c.aggregate_ready(0, {0, 1})
    assert c.aggregate_ready(0, {0, 1, 2})
    c.finish(2)
    assert c.aggregate_ready(0, {0, 1}) and c.aggregate_ready(0, {0, 1, 2})
    with pytest.raises(ValueError):
        c.aggregate_ready(0, {0, 7})


def test_ssp_with_staleness_zero_is_bsp_and_infinity_is_asp():
    assert effective_mode("ssp", 0) == ("bsp", None)
    assert effective_mode("ssp", math.inf) == ("asp", None)
    assert effective_mode("ssp", 3) == ("ssp", 3) and effective_mode("asp", None) == ("asp", None)
    assert all(valid_staleness(s) for s in (0, 3, np.int64(2), math.inf))
    assert not any(valid_staleness(s) for s in (None, -1, 1.5, -math.inf, True, "3"))


def test_the_cli_takes_inf_for_an_unbounded_staleness():
    from paratrain.train.options import build_parser as parser
    assert parser().parse_args(["--strategy", "ps", "--consistency", "ssp", "--staleness", "inf"]).staleness == math.inf
    assert parser().parse_args(["--staleness", "3"]).staleness == 3
    with pytest.raises(SystemExit):
        parser().parse_args(["--staleness", "three"])


def test_clocks_arguments():
    for args in [(2, "hogwild"), (2, "ssp"), (2, "ssp", -1), (2, "ssp", 1.5), (2, "ssp", math.inf),
                 (2, "bsp", 2), (2, "asp", 3), (0, "bsp"), (True, "bsp")]:
        with pytest.raises(ValueError):
            Clocks(*args)
    assert Clocks(2, "bsp", 0).staleness == 0 and Clocks(2, "ssp", np.int64(2)).staleness == 2
    c = Clocks(2, "bsp")
    for bad in (2, -1, 1.0, True, "0", None):
        with pytest.raises(ValueError, match="unknown worker"):
            c.advance(bad)
    assert c.advance(np.int64(1)) == 1


@pytest.mark.parametrize("name,hyper", [("sgd", dict(lr=0.1)), ("sgd", dict(lr=0.1, momentum=0.9, nesterov=True)),
                                        ("sgd", dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
                                        ("adagrad", dict(lr=0.1, weight_decay=0.01)), ("adam", dict(lr=0.01)),
                                        ("adam", dict(lr=0.01, weight_decay=0.1))])
def test_grad_scale_is_the_step_on_the_scaled_gradient(name, hyper):
    """BSP applies a round's sum with grad_scale = 1/W folded into the arithmetic
    (shard.py); it must be the step on the average itself, here checked against
    torch.optim taking the averaged gradient, over a few steps so state carries."""
    rng = np.random.default_rng(3)
    p0 = rng.standard_normal(1000).astype(np.float32)
    sums = [rng.standard_normal(1000).astype(np.float32) * 3 for _ in range(4)]
    ours, flat = make_optimizer(name, **hyper), p0.copy()
    p = torch.nn.Parameter(torch.tensor(p0))
    ref = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam}[name]([p], **hyper)
    for t, g in enumerate(sums):
        ours.step(flat, g, grad_scale=1 / 3)
        p.grad = torch.tensor(g) / 3
        ref.step()
        np.testing.assert_allclose(flat, p.detach().numpy(), rtol=1e-5, atol=1e-6, err_msg=f"step {t + 1}")


def test_waiting_requests_keep_their_first_deadline_and_expire():
    """ps/waiting.py: a retried request that must wait again keeps its first deadline,
    so a pull retried after every push still expires on time; expired() removes only
    the late ones; payloads are copied (ZeroMQ reuses the received frames)."""
    import time
    from paratrain.ps.waiting import Waiting
    w = Waiting(timeout=0.05)
    frame = bytearray(b"abc")
    w.add(b"a", "h1", {}, memoryview(frame))
    w.add(b"b", "h2", {}, b"", deadline=time.monotonic() + 60)
    frame[0] = ord("X")
    first = w.take()
    assert len(w) == 0 and first[0][4] == b"abc"
    for deadline, ident, h, meta, payload in first:   # retried, and both must wait again
        before = len(w)
        w.add(ident, h, meta, payload)
        w.keep_deadline(before, deadline)
    assert [item[0] for item in w.items] == [d for d, *_ in first]
    time.sleep(0.06)
    late = w.expired()
    assert [item[1] for item in late] == [b"a"] and [item[1] for item in w.items] == [b"b"]


def test_weight_prediction_serves_value_plus_tau_times_last_update():
    """shard.py, ASP/SSP with predict: a read gets value + tau * delta, delta the last
    update, tau a running mean of the pushes by others between this worker's read and
    its push (from W - 1); an exact read gets the value; the value itself is only ever
    changed by pushes. Checked against numpy with plain SGD (update = -lr/W * g)."""
    from paratrain.ps.shard import Shard
    W, lr = 3, 0.3
    v0 = np.arange(4, dtype=np.float32)
    shard = Shard(0, 0, 4, v0.copy(), SGD(lr=lr))
    shard.enable_prediction(W)
    out = np.empty(4, np.float32)
    np.testing.assert_array_equal(shard.read_into(0, out), v0)          # no update yet: delta = 0
    g1, g2 = np.full(4, 1.0, np.float32), np.arange(4, dtype=np.float32)
    shard.apply_now(1, g1, 1 / W)        # worker 1 read nothing since update 0: 0 others -> tau 0.5 * (2 + 0)
    shard.apply_now(2, g2, 1 / W)        # worker 2: 1 other push since its (implicit) read at 0 -> 0.5 * (2 + 1)
    value = v0 - lr / W * g1 - lr / W * g2
    np.testing.assert_allclose(shard.value, value, rtol=1e-6)
    assert shard.tau == [2.0, 1.0, 1.5]
    np.testing.assert_allclose(shard.read_into(0, out), value + 2.0 * (-lr / W * g2), rtol=1e-6)
    np.testing.assert_allclose(shard.read_into(2, out, exact=True), value, rtol=1e-6)
    shard.apply_now(1, g2, 1 / W)        # worker 0 read at 2 updates; worker 1 pushes: 2 others since its read at 0
    assert shard.tau[1] == 0.5 * (1.0 + 2)
    np.testing.assert_allclose(shard.value, value - lr / W * g2, rtol=1e-6)


def test_prediction_damps_each_gradient_element_by_its_gap():
    """shard.py: with prediction, after GAP_WARMUP pushes a worker's gradient is divided
    elementwise by max(1, |value - served| / step), served what that worker was given and
    step the running mean of |update|; checked against numpy with plain SGD."""
    from paratrain.ps.shard import GAP_WARMUP, STEP_SIZE_DECAY, Shard
    W, lr = 2, 0.1
    value = np.array([1.0, -2.0, 0.5, 3.0])
    shard = Shard(0, 0, 4, value.astype(np.float32), SGD(lr=lr))
    shard.enable_prediction(W)
    step, delta, tau0 = np.zeros(4), np.zeros(4), float(W - 1)
    warm = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    for _ in range(GAP_WARMUP):          # worker 1 never reads: nothing of its is damped
        shard.apply_now(1, warm, 1 / W)
        delta = -lr / W * warm
        value = value + delta
        step = STEP_SIZE_DECAY * step + (1 - STEP_SIZE_DECAY) * np.abs(delta)
    out = np.empty(4, np.float32)
    shard.read_into(0, out)              # worker 0 is served value + tau * delta (tau = W - 1 = 1)
    served = value + tau0 * delta
    np.testing.assert_allclose(out, served, rtol=1e-5)
    turn = np.array([4.0, 0.0, 1.0, 2.0], np.float32)   # worker 1 turns: the prediction misses unevenly
    for _ in range(2):
        shard.apply_now(1, turn, 1 / W)
        delta = -lr / W * turn
        value = value + delta
        step = STEP_SIZE_DECAY * step + (1 - STEP_SIZE_DECAY) * np.abs(delta)
    g0 = np.array([1.0, 1.0, 1.0, 1.0], np.float32)
    gap = np.maximum(1.0, np.abs(value - served) / step)
    assert (gap > 1).any() and (gap == 1).any()         # some elements damped, some not
    shard.apply_now(0, g0, 1 / W)
    np.testing.assert_allclose(shard.value, value - lr / W * g0 / gap, rtol=1e-5)


def test_a_request_that_overtakes_its_clock_logs_the_clocks_it_stands_for():
    """consistency.observe: a request carrying clock 3 from a worker the server has at
    clock 1 (its clock messages still on their way, or lost with a restarted server)
    moves it to 3 and logs 2 and 3; the late clock messages then change nothing."""
    from paratrain.ps.consistency import Clocks
    c = Clocks(2, "asp", None)
    c.advance(0)
    c.observe(0, 3)
    assert c.clock_of(0) == 3 and list(c.log) == [(0, 1), (0, 2), (0, 3)]
    c.observe(0, 2)
    assert c.clock_of(0) == 3 and len(c.log) == 3


def test_prediction_looks_momentum_further_ahead():
    """shard.py: with a momentum optimizer the read is value + (tau + mu) * delta,
    mu the momentum coefficient (Nesterov's lookahead; Adam's beta1, SGD's momentum,
    none for Adagrad). Checked against SGD with momentum worked out in numpy."""
    from paratrain.ps.optimizers import Adagrad, Adam
    from paratrain.ps.shard import Shard
    W, lr, mu = 3, 0.3, 0.5
    v0 = np.arange(4, dtype=np.float32)
    shard = Shard(0, 0, 4, v0.copy(), SGD(lr=lr, momentum=mu))
    shard.enable_prediction(W)
    g1, g2 = np.full(4, 1.0, np.float32), np.arange(4, dtype=np.float32)
    shard.apply_now(1, g1, 1 / W)
    shard.apply_now(2, g2, 1 / W)
    p1 = v0 - lr / W * g1                 # torch's first step: the buffer is the gradient
    p2 = p1 - lr / W * (mu * g1 + g2)
    np.testing.assert_allclose(shard.value, p2, rtol=1e-6)
    out = np.empty(4, np.float32)
    np.testing.assert_allclose(shard.read_into(0, out), p2 + (2.0 + mu) * (p2 - p1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(shard.read_into(0, out, exact=True), p2, rtol=1e-6)
    assert Adam(lr=1e-3, betas=(0.8, 0.99)).lookahead == 0.8 and Adagrad(lr=0.1).lookahead == 0.0
    assert SGD(lr=0.1).lookahead == 0.0


def _fused_and_alone(name, hyper, rng):
    """Four shards of random weights twice: as views of one buffer under a FusedRounds, and
    each with its own copy; (sizes, offsets, buffer, fused shards, lone shards, fused)."""
    from paratrain.ps.fused import FusedRounds
    from paratrain.ps.shard import Shard
    sizes = [5, 130, 17, 1000]
    start = rng.standard_normal(sum(sizes)).astype(np.float32)
    offsets = np.cumsum([0] + sizes)
    buffer = start.copy()
    fused_shards = [Shard(k, 0, n, buffer[a:b], make_optimizer(name, **hyper))
                    for k, (n, a, b) in enumerate(zip(sizes, offsets, offsets[1:]))]
    alone = [Shard(k, 0, n, start[a:b].copy(), make_optimizer(name, **hyper))
             for k, (n, a, b) in enumerate(zip(sizes, offsets, offsets[1:]))]
    return sizes, offsets, buffer, fused_shards, alone, FusedRounds(fused_shards, buffer, name, hyper)


@pytest.mark.parametrize("name,hyper", SETTINGS, ids=IDS)
def test_fused_rounds_step_every_shard_as_its_own_step_would_bitwise(name, hyper):
    """fused.py: shards whose values are views of one buffer, two workers' gradients
    gathered for each round, stepped as one optimizer call when every shard's round is
    complete, reach bitwise the weights of the same shards stepped one by one; a round
    that only some shards have complete is left to them; and state loaded into a shard
    (a checkpoint) is linked into the one buffer."""
    rng = np.random.default_rng(3)
    sizes, offsets, buffer, fused_shards, alone, fused = _fused_and_alone(name, hyper, rng)
    every = lambda clock, pushed: len(pushed) == 2   # noqa: E731 - the consistency model's word: both pushed
    for clock in range(4):
        grads = [rng.standard_normal(sum(sizes)).astype(np.float32) for _ in range(2)]
        for worker, g in enumerate(grads):
            for shards in (fused_shards, alone):
                for s, a, b in zip(shards, offsets, offsets[1:]):
                    s.gather(worker, g[a:b])
        assert fused.apply_if_complete(every)
        for s in alone:
            s.apply_round()
        assert all(f.applied == s.applied == clock + 1 and f.opt.steps == s.opt.steps for f, s in zip(fused_shards, alone))
        assert np.array_equal(buffer, np.concatenate([s.value for s in alone]))
    assert fused.rounds == 4
    fused_shards[0].gather(0, np.ones(sizes[0], np.float32))   # one shard's round only begun
    assert not fused.apply_if_complete(every) and fused_shards[0].pushed == {0}
    if fused.opt.ARRAYS:
        state = fused_shards[2].opt.state_dict()
        fused_shards[2].opt.load_state_dict({**state, **{k: np.full(sizes[2], 7.0, np.float32) for k in fused.opt.ARRAYS}})
        fused.link()
        a, b = offsets[2], offsets[3]
        assert all((fused.opt.state[k][a:b] == 7.0).all() and np.shares_memory(fused_shards[2].opt.state[k], fused.opt.state[k])
                   for k in fused.opt.ARRAYS)


@pytest.mark.parametrize("name,hyper", SETTINGS, ids=IDS)
def test_a_fused_asp_push_steps_every_shard_as_its_own_apply_now_would_bitwise(name, hyper):
    """fused.py under ASP / SSP: each worker's push of every shard, applied on arrival at 1/W
    of the learning rate by one step over the buffer, reaches bitwise the weights of the
    same pushes applied shard by shard; after a push that came piece by piece (one shard
    stepped alone, the step counts apart) the shards step alone."""
    rng = np.random.default_rng(5)
    sizes, offsets, buffer, fused_shards, alone, fused = _fused_and_alone(name, hyper, rng)
    for _ in range(5):   # pushes of two workers, in the order they arrive
        g = rng.standard_normal(sum(sizes)).astype(np.float32)
        assert fused.apply_push(g, 1 / 2)
        for s, a, b in zip(alone, offsets, offsets[1:]):
            s.apply_now(0, g[a:b], 1 / 2)
        assert all(f.opt.steps == s.opt.steps for f, s in zip(fused_shards, alone))
        assert np.array_equal(buffer, np.concatenate([s.value for s in alone]))
    assert fused.rounds == 5
    fused_shards[1].apply_now(1, np.ones(sizes[1], np.float32), 1 / 2)   # one piece on its own
    assert not fused.apply_push(np.ones(sum(sizes), np.float32), 1 / 2) and fused.rounds == 5


@pytest.mark.parametrize("name", ["adam", "adagrad"])
def test_a_server_over_pushes_mostly_zero_matches_torch(name):
    """A server's Adam or Adagrad over gradients 99% zero (a top-k push), where most of v (the
    sum) stays exactly zero and its square root is taken outside torch: the same steps as
    torch's, to rounding."""
    rng = np.random.default_rng(5)
    p0 = rng.standard_normal(4099).astype(np.float32)
    grads = [(rng.standard_normal(4099) * (rng.random(4099) < 0.01)).astype(np.float32) for _ in range(STEPS)]
    want = _torch_trajectory(name, {"lr": 0.01}, p0, grads)
    opt, p = make_optimizer(name, lr=0.01), p0.copy()
    for t, g in enumerate(grads):
        opt.step(p, np.frombuffer(g.tobytes(), dtype=np.float32))
        np.testing.assert_allclose(p, want[t], **TOL, err_msg=f"{name} step {t + 1}")
    assert (opt.state[opt.ARRAYS[-1]] == 0).mean() > 0.5 and not np.array_equal(p, p0)
