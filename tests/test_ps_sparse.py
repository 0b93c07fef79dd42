"""Sparse embedding rows on the parameter servers (pt.ps.Embedding, rows.py),
with servers in threads of this process and workers as Clients, checked
against numpy and against torch's own embedding and optimizers."""
import threading

import numpy as np
import pytest
import torch

import paratrain as pt
from paratrain.launch.local import free_port
from paratrain.ps.client import Client, PSError
from paratrain.ps.rows import initial_rows
from paratrain.ps.server import Server


@pytest.fixture
def servers():
    """Start S servers in threads; yields a function S -> their addresses."""
    started = []

    def start(S, timeout=20.0):
        addrs = [f"tcp://127.0.0.1:{free_port()}" for _ in range(S)]
        for i, a in enumerate(addrs):
            srv = Server(i, a, timeout=timeout)
            t = threading.Thread(target=srv.serve, daemon=True)
            t.start()
            started.append((srv, t))
        return addrs

    yield start
    for srv, t in started:
        srv.stopping = True
    for srv, t in started:
        t.join(5)


class TinyRecommender(torch.nn.Module):
    def __init__(self, embedding):
        super().__init__()
        self.emb = embedding
        torch.manual_seed(0)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, ids):
        return self.head(self.emb(ids).mean(dim=1)).squeeze(-1)


def _batches(steps, num, seed=1):
    g = np.random.default_rng(seed)
    return [(torch.from_numpy(g.integers(0, num, size=(6, 3))), torch.from_numpy(g.normal(size=6).astype(np.float32)))
            for _ in range(steps)]


@pytest.mark.timeout(60)
def test_push_touches_exactly_the_batch_rows_and_pull_returns_what_was_pushed(servers):
    addrs = servers(2)
    model = TinyRecommender(pt.ps.Embedding(1000, 8, std=0.5, seed=7))
    ps = Client(addrs, 0, 1, timeout=20)
    try:
        ps.register(model, optimizer="sgd", consistency="asp", lr=1.0)   # applied on arrival, no rounds
        rows = np.array([3, 998, 17, 4, 500])
        before = ps.pull_rows(0, rows)
        np.testing.assert_allclose(before, initial_rows(7, 0, rows, 8, 0.5))
        assert abs(float(initial_rows(7, 0, np.arange(1000), 8, 0.5).std()) - 0.5) < 0.02
        ids = np.array([3, 4, 3, 998])          # row 3 twice: its gradients add up
        grads = np.arange(32, dtype=np.float32).reshape(4, 8) / 10
        ps.push_rows(0, ids, grads)
        ps.clock()
        after = ps.pull_rows(0, rows)
        want = before.copy()
        for r, g in zip(ids, grads):
            want[list(rows).index(r)] -= g      # SGD, lr 1, one worker: value - gradient
        np.testing.assert_allclose(after, want, rtol=1e-6)
        stored = sum(ps.stats(s)["tables"]["0"]["rows"] for s in range(2))
        pushed = sum(ps.stats(s)["tables"]["0"]["rows_pushed"] for s in range(2))
        assert stored == 5 and pushed == 4      # only the rows named were created and sent
        # the module: a forward pulls its rows, push() sends exactly their gradients
        ids = torch.tensor([[10, 11, 10], [12, 10, 13]])
        ps.pull(model)
        model(ids).sum().backward()
        rows_sent, grads_sent = model.emb.take_gradients()
        assert sorted(rows_sent.tolist()) == [10, 11, 12, 13] and grads_sent.shape == (4, 8)
        with pytest.raises(PSError, match=r"lie in \[0, 1000\)"):
            ps.push_rows(0, np.array([1000]), np.zeros((1, 8), np.float32))
        with pytest.raises(IndexError, match="must lie in"):
            model(torch.tensor([[1000]]))
    finally:
        ps.close()


def _train_ps(addrs, optimizer, hyper, batches, workers=1, worker=0, model=None):
    model = model or TinyRecommender(pt.ps.Embedding(50, 8, std=0.5, seed=3))
    ps = Client(addrs, worker, workers, timeout=20)
    ps.register(model, optimizer=optimizer, **hyper)
    for ids, y in batches:
        ps.pull(model)
        model.zero_grad()
        torch.nn.functional.mse_loss(model(ids), y).backward()
        ps.push(model)
        ps.clock()
    ps.pull(model)
    table = ps.pull_rows(0, np.arange(50))
    ps.close()
    return model, table


@pytest.mark.timeout(60)
@pytest.mark.parametrize("optimizer,hyper,torch_opt", [
    ("sgd", {"lr": 0.5}, lambda p: torch.optim.SGD(p, lr=0.5)),
    ("adagrad", {"lr": 0.3}, lambda p: torch.optim.Adagrad(p, lr=0.3)),
])
def test_embedding_training_equals_torch_embedding(servers, optimizer, hyper, torch_opt):
    """One worker, BSP, 2 servers: the same trajectory as torch.nn.Embedding holding the
    whole table in the process, with torch's optimizer (untouched rows get a zero
    gradient, which moves neither SGD without momentum nor Adagrad)."""
    batches = _batches(12, 50)
    model, table = _train_ps(servers(2), optimizer, hyper, batches)
    ref = TinyRecommender(torch.nn.Embedding(50, 8))
    with torch.no_grad():
        ref.emb.weight.copy_(torch.from_numpy(initial_rows(3, 0, np.arange(50), 8, 0.5)))
    opt = torch_opt(ref.parameters())
    for ids, y in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(ref(ids), y).backward()
        opt.step()
    np.testing.assert_allclose(table, ref.emb.weight.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.head.weight.detach().numpy(), ref.head.weight.detach().numpy(), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.timeout(60)
def test_bsp_embedding_with_two_workers_averages_their_row_gradients(servers):
    """Two workers in threads, each with its own batches: equals one process stepping on
    the average of the two workers' gradients (torch's dense embedding, SGD)."""
    addrs = servers(2)
    a, b = _batches(6, 50, seed=1), _batches(6, 50, seed=2)
    out = {}
    # the models are built here: TinyRecommender seeds torch's global generator, which threads share
    models = [TinyRecommender(pt.ps.Embedding(50, 8, std=0.5, seed=3)) for _ in range(2)]
    threads = [threading.Thread(target=lambda w, bs: out.__setitem__(w, _train_ps(addrs, "sgd", {"lr": 0.5}, bs, 2, w,
                                                                                  model=models[w])),
                                args=(w, bs)) for w, bs in ((0, a), (1, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(50)
    ref = TinyRecommender(torch.nn.Embedding(50, 8))
    with torch.no_grad():
        ref.emb.weight.copy_(torch.from_numpy(initial_rows(3, 0, np.arange(50), 8, 0.5)))
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for (ia, ya), (ib, yb) in zip(a, b):
        opt.zero_grad()
        loss = (torch.nn.functional.mse_loss(ref(ia), ya) + torch.nn.functional.mse_loss(ref(ib), yb)) / 2
        loss.backward()
        opt.step()
    for w in (0, 1):
        np.testing.assert_allclose(out[w][1], ref.emb.weight.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_initial_rows_depend_only_on_seed_table_row():
    r = np.array([5, 1, 999_999_999])
    np.testing.assert_array_equal(initial_rows(1, 2, r, 4, 1.0)[1], initial_rows(1, 2, np.array([1]), 4, 1.0)[0])
    assert not np.allclose(initial_rows(1, 2, r, 4, 1.0), initial_rows(1, 3, r, 4, 1.0))
    assert not np.allclose(initial_rows(1, 2, r, 4, 1.0), initial_rows(2, 2, r, 4, 1.0))
    big = initial_rows(0, 0, np.arange(20000), 16, 1.0)
    assert abs(big.mean()) < 0.01 and abs(big.std() - 1) < 0.01   # N(0, 1), as torch.nn.Embedding


def test_embedding_needs_registration():
    with pytest.raises(RuntimeError, match="register"):
        pt.ps.Embedding(10, 4)(torch.tensor([1]))
