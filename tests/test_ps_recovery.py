"""Server checkpoints (server_state.py) and a killed server coming back from one:
the run finishes, and its weights are those of the checkpoint plus the updates
after the restart, checked against plain torch training that skips exactly the
lost steps."""
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

import paratrain as pt
from paratrain.launch.local import free_port
from paratrain.ps import server_state
from paratrain.ps.client import Client
from paratrain.ps.server import Server


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)) for _ in range(n)]


def _grad_step(model, batch):
    model.zero_grad()
    torch.nn.functional.mse_loss(model(batch[0]), batch[1]).backward()


def _start_server(addr, ckpt_dir, restart=0):
    env = dict(os.environ, PARATRAIN_PS_INDEX="0", PARATRAIN_PS_BIND=addr, PARATRAIN_PS_CHECKPOINT_DIR=ckpt_dir,
               PARATRAIN_PS_CHECKPOINT_CLOCKS="5", PARATRAIN_PS_CHECKPOINT_SECONDS="0",
               PARATRAIN_PS_RESTART=str(restart), PARATRAIN_TIMEOUT="30")
    return subprocess.Popen([sys.executable, "-m", "paratrain.ps.server"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("calls", ["pull-push-clock", "step"])
def test_killed_server_restarts_from_checkpoint_and_the_run_finishes(tmp_path, calls):
    """With separate calls over ZeroMQ, and with step() rung on the server's doorbell
    (doorbell.py): the dead server's bell has no reader, so that step goes by ZeroMQ."""
    steps, kill_after = 14, 8
    addr = f"tcp://127.0.0.1:{free_port()}"
    server = _start_server(addr, str(tmp_path))
    batches = _batches(steps)
    model = _model()
    ps = Client([addr], 0, 1, timeout=30)
    try:
        ps.register(model, optimizer="sgd", lr=0.1, momentum=0.9)
        for step in range(steps):
            if step == kill_after:   # the server dies between two steps; the launcher would restart it
                server.send_signal(signal.SIGKILL)
                server.wait(10)
                meta, _ = server_state.read(server_state.checkpoint_path(str(tmp_path), 0))
                saved_at = meta["shards"][0]["applied"]
                server = _start_server(addr, str(tmp_path), restart=1)
            if calls == "step":
                if step == 0:
                    ps.pull(model)
                _grad_step(model, batches[step])
                ps.step()   # push, clock, and the next step's weights
                continue
            ps.pull(model)
            _grad_step(model, batches[step])
            ps.push(model)
            ps.clock()
        ps.pull(model)
        assert calls != "step" or ps.bells[0] is not None   # the new server's bells, once it was found
        assert calls != "step" or ps.stats()["doorbell_requests"] > 0   # and rung again after the reconnection
        final = [p.detach().clone() for p in model.parameters()]
        assert ps.reconnects >= 1
    finally:
        ps.close()
        server.terminate()
        out = server.communicate(timeout=10)[0]
    assert saved_at == 5, out   # every 5 clocks: the checkpoint holds steps 0..4
    assert "restored" in out and "updates after it are lost" in out
    # reference: torch's SGD; at the kill, weights and momentum go back to the checkpoint's
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        if step == saved_at:
            snapshot = ([p.detach().clone() for p in ref.parameters()],
                        {k: v for k, v in __import__("copy").deepcopy(opt.state_dict()).items()})
        if step == kill_after and calls == "step":   # that step's gradient was computed before the kill
            _grad_step(ref, batches[step])
        if step == kill_after:
            with torch.no_grad():
                for p, s in zip(ref.parameters(), snapshot[0]):
                    p.copy_(s)
            opt.load_state_dict(snapshot[1])
        if step != kill_after or calls != "step":
            _grad_step(ref, batches[step])
        opt.step()
    for got, want in zip(final, ref.parameters()):
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


def test_checkpoint_round_trip_keeps_weights_optimizer_state_clocks_and_rows(tmp_path):
    import threading
    addr = f"tcp://127.0.0.1:{free_port()}"
    srv = Server(0, addr, timeout=10, checkpoint_dir=str(tmp_path), checkpoint_seconds=0)
    t = threading.Thread(target=srv.serve, daemon=True)
    t.start()
    model = torch.nn.ModuleDict({"lin": torch.nn.Linear(3, 2), "emb": pt.ps.Embedding(100, 4, seed=2)})
    ps = Client([addr], 0, 2, timeout=10)
    try:
        ps.register(model, optimizer="adam", consistency="asp", lr=0.01)   # applied per push: worker 1 never comes
        for _ in range(3):
            model.zero_grad()
            (model["lin"](torch.ones(1, 3)).sum() + model["emb"](torch.tensor([5, 7, 5])).sum()).backward()
            ps.push(model)
            ps.clock()
    finally:
        ps.close()
        srv.stopping = True
        t.join(5)
    path = server_state.checkpoint_path(str(tmp_path), 0)
    assert os.path.exists(path)   # written on a clean stop
    again = Server(0, f"tcp://127.0.0.1:{free_port()}", checkpoint_dir=str(tmp_path))
    try:
        again.restore()
        for key, shard in srv.shards.items():
            np.testing.assert_array_equal(again.shards[key].value, shard.value)
            a, b = again.shards[key].opt.state_dict(), shard.opt.state_dict()
            assert a["step"] == b["step"] == 3
            np.testing.assert_array_equal(a["exp_avg"], b["exp_avg"])
        old, new = srv.tables[0], again.tables[0]
        assert new.used == old.used == 2
        np.testing.assert_array_equal(new.read(np.array([5, 7])), old.read(np.array([5, 7])))
        assert again.clocks.clocks == [3, 0] and again.clocks.done == {0} and again.mode == "asp"
    finally:
        again.sock.close(linger=0)
        again.ctx.term()


def test_damaged_checkpoint_is_refused_with_a_clear_error(tmp_path):
    path = server_state.checkpoint_path(str(tmp_path), 0)
    with open(path, "wb") as f:
        f.write(b"PK\x03\x04 not really a zip")
    srv = Server(0, f"tcp://127.0.0.1:{free_port()}", checkpoint_dir=str(tmp_path))
    try:
        with pytest.raises(ValueError, match="not a readable parameter-server checkpoint.*move it away"):
            srv.restore()
    finally:
        srv.sock.close(linger=0)
        srv.ctx.term()
