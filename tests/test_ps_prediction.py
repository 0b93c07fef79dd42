"""Weight prediction on the parameter server (ps/shard.py), through the Client API:
a server in a thread of this process, two workers as Clients, over the shared
segment (whose pulls and pushes are rung on its doorbell) and over TCP, checked
against numpy with plain SGD (an ASP push is the update -lr/W * g)."""
import threading

import numpy as np
import pytest
import torch

from paratrain.launch.local import free_port
from paratrain.ps.client import Client
from paratrain.ps.server import Server
from paratrain.ps.wire import Op


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shm", ["1", "0"])
def test_predicted_pulls_extrapolate_the_last_update_and_exact_pulls_do_not(shm, monkeypatch):
    monkeypatch.setenv("PARATRAIN_PS_SHM", shm)
    addr = f"tcp://127.0.0.1:{free_port()}"
    srv = Server(0, addr, timeout=20)
    t = threading.Thread(target=srv.serve, daemon=True)
    t.start()
    W, lr = 2, 0.2
    models = [torch.nn.ParameterDict({"w": torch.nn.Parameter(torch.zeros(5))}) for _ in range(W)]
    clients = [Client([addr], w, W, timeout=20) for w in range(W)]
    try:
        for c, m in zip(clients, models):   # worker 0 first: its values start the server
            c.register(m, optimizer="sgd", consistency="asp", predict=True, lr=lr)
        for c, m in zip(clients, models):
            c.pull(m)                        # both read at update 0
        g = [np.arange(5, dtype=np.float32) + 1, np.full(5, -2.0, np.float32)]
        for w in range(W):                   # worker 0 pushes (0 others since its read: tau 0.5 * (1 + 0)),
            models[w]["w"].grad = torch.tensor(g[w])   # then worker 1 (1 other: tau 0.5 * (1 + 1))
            clients[w].push(models[w])
            clients[w].clock()
        value = -lr / W * (g[0] + g[1])
        delta = -lr / W * g[1]
        clients[0].pull(models[0])
        np.testing.assert_allclose(models[0]["w"].detach().numpy(), value + 0.5 * delta, rtol=1e-6, atol=1e-6)
        clients[1].pull(models[1])
        np.testing.assert_allclose(models[1]["w"].detach().numpy(), value + 1.0 * delta, rtol=1e-6, atol=1e-6)
        rung = srv.doorbell_requests
        if shm == "1":   # a record of a request that may not be rung is dropped; the server serves on
            clients[0].bells[0].ring(int(Op.STATS), 0, 0, 99)
        clients[0].pull(models[0], exact=True)   # (the exact flag, rung on the doorbell with shm)
        np.testing.assert_allclose(models[0]["w"].detach().numpy(), value, rtol=1e-6, atol=1e-6)
        assert srv.predict and (clients[0].regions[0] is not None) == (shm == "1")
        assert srv.doorbell_requests == (rung + 1 if shm == "1" else 0)   # pulls and pushes were rung
        assert shm == "0" or rung == 4 * W   # 2 pulls, a push and a clock each
    finally:
        for c in clients:
            c.close()
        srv.stopping = True
        t.join(5)


def test_prediction_is_refused_where_it_has_no_meaning(tmp_path):
    """--predict-weights with BSP (or SSP s=0, which is BSP) is a usage error, said before anything starts."""
    from test_train import front_end
    res = front_end(tmp_path, "--strategy", "ps", "--consistency", "bsp", "--predict-weights")
    assert res.returncode != 0 and "--predict-weights is for --strategy ps with --consistency asp or ssp" in \
        res.stderr + res.stdout
