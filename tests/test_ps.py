"""The parameter server through real processes (`paratrain run --servers S -n W`),
checked against independent references (tests/workers/ps_train.py), and a
server's answer to malformed or unauthorised messages."""
import threading

import numpy as np
import pytest
import zmq

from conftest import launch
from paratrain.launch.local import free_port
from paratrain.ps import wire
from paratrain.ps.server import Server
from paratrain.ps.wire import Header, Op


def _passed(res, n, mode):
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert res.stdout.count(f"ps {mode} passed") == n, out[-4000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_bsp_one_worker_equals_plain_training_step_for_step(optimizer):
    _passed(launch(1, "ps_train.py", "single", "--optimizer", optimizer, launcher_args=["--servers", "1"]),
            1, "single")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("workers,servers,optimizer,transport", [
    (2, 2, "sgd", "shm"), (3, 2, "adam", "shm-step"), (2, 2, "sgd", "shm-step-nobells"), (2, 2, "adam", "tcp"),
    (3, 2, "adam", "shm-ssp0")])
def test_bsp_equals_synchronous_data_parallelism(workers, servers, optimizer, transport):
    """Through the same-host shared segments (the default), with pull/push/clock or
    ps.step() (push, clock and pull in one request), rung on the doorbells (doorbell.py) or
    sent through ZeroMQ, over TCP alone (shared.py), and as SSP with staleness 0."""
    res = launch(workers, "ps_train.py", "bsp", "--optimizer", optimizer, launcher_args=["--servers", str(servers)],
                 env={"PARATRAIN_PS_SHM": "0" if transport == "tcp" else "1",
                      "PARATRAIN_PS_BELLS": "0" if transport.endswith("nobells") else "1",
                      "PS_TRAIN_STEP": "1" if "step" in transport else "0",
                      "PS_TRAIN_SSP0": "1" if transport == "shm-ssp0" else "0"})
    rung = transport.startswith("shm") and not transport.endswith("nobells")   # (pushes, pulls, steps)
    lines = [line for line in res.stdout.splitlines() if "doorbell requests" in line]
    assert len(lines) == workers and all(("doorbell requests 0" in line) != rung for line in lines), lines
    # a push of every piece in one message completes every shard's round at once: one optimizer step
    # over the server's buffer (fused.py); over TCP each piece is a message, so the shards step alone
    fused = [line for line in res.stdout.splitlines() if "fused rounds" in line]
    assert len(fused) == workers and all(("fused rounds 0" in line) == (transport == "tcp") for line in fused), fused
    transport = transport.split("-")[0]
    assert res.stdout.count(f"transport {transport}") == workers, res.stdout[-2000:]
    _passed(res, workers, "bsp")
    assert "parameter servers: 2" in res.stdout  # the placement is printed


@pytest.mark.timeout(150)
def test_ssp_never_serves_a_read_more_than_s_clocks_ahead():
    res = launch(3, "ps_train.py", "ssp", launcher_args=["--servers", "2"], env={"PS_TRAIN_STEP": "1"})
    _passed(res, 3, "ssp")
    assert "staleness histogram" in res.stdout


@pytest.mark.timeout(150)
@pytest.mark.parametrize("flags", [[], ["--ssp-inf"]], ids=["asp", "ssp-infinity"])
def test_asp_makes_progress_while_a_worker_is_paused(flags):
    """ASP, and SSP with an unbounded staleness, which is ASP (the issue: s = infinity like ASP)."""
    res = launch(2, "ps_train.py", "asp", *flags, launcher_args=["--servers", "1"])
    _passed(res, 2, "asp")
    assert "worker 0 finished 10 steps while worker 1 was paused" in res.stdout
    # each push of every piece through the shared segment: one optimizer step over the buffer
    # (fused.py); worker 0 asks after its 10 pushes, worker 1 after all 20
    fused = sorted(int(line.split()[-1]) for line in res.stdout.splitlines() if "fused rounds" in line)
    assert len(fused) == 2 and 10 <= fused[0] <= fused[1] == 20, fused


@pytest.mark.timeout(60)
def test_server_answers_bad_messages_with_errors_and_keeps_serving():
    addr = f"tcp://127.0.0.1:{free_port()}"
    server = Server(0, addr, token=wire.token_digest("s3cret"), timeout=5)
    t = threading.Thread(target=server.serve, daemon=True)
    t.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(addr)

    def ask(frames):
        sock.send_multipart(frames)
        h, meta, _ = wire.decode(sock.recv_multipart(), max_payload=1 << 20)
        return h, meta

    try:
        h, meta = ask([b"garbage", b"", b""])
        assert h.op == Op.ERROR and "malformed message" in meta["error"]
        head = Header(op=Op.STATS, worker=0, token=wire.token_digest("wrong"))
        h, meta = ask(wire.encode(head))
        assert h.op == Op.ERROR and "token" in meta["error"]
        head = Header(op=Op.PULL, worker=0, key=0, lo=0, hi=4, token=wire.token_digest("s3cret"))
        h, meta = ask(wire.encode(head))
        assert h.op == Op.ERROR and "register" in meta["error"]
        head = Header(op=Op.REGISTER, worker=0, dtype_code=3, token=wire.token_digest("s3cret"))
        meta = {"workers": 1, "mode": "bsp", "optimizer": "sgd", "hyper": {"lr": 0.1}, "pieces": [[0, 0, 4]]}
        h, _ = ask(wire.encode(head, meta, np.arange(4, dtype=np.float32)))
        assert h.op == Op.REPLY  # still serving after the bad ones
        head = Header(op=Op.PUSH_PACKED, worker=0, key=-1, lo=0, hi=3, dtype_code=7, token=wire.token_digest("s3cret"))
        h, meta = ask(wire.encode(head, {"codec": "topk", "k": 1}, np.zeros(8, np.uint8)))
        assert h.op == Op.ERROR and "carries 4 entries, not 3" in meta["error"]   # a push of every shard
        head = Header(op=Op.PULL, worker=0, key=0, lo=0, hi=4, token=wire.token_digest("s3cret"))
        sock.send_multipart(wire.encode(head))
        h, _, payload = wire.decode(sock.recv_multipart(), max_payload=1 << 20)
        assert h.op == Op.REPLY and np.frombuffer(payload, np.float32).tolist() == [0, 1, 2, 3]
    finally:
        server.stopping = True
        t.join(5)
        sock.close()
        ctx.term()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shm", ["1", "0"])
def test_bsp_reports_the_missing_worker_instead_of_hanging(shm, monkeypatch):
    """Worker 1 registers and then never pushes (stuck, or gone without a word):
    worker 0's next pull waits for clock 0's round, and after the server's
    timeout it gets an error naming worker 1 and its clock, not a hang."""
    import torch
    from paratrain.ps.client import Client, PSError
    monkeypatch.setenv("PARATRAIN_PS_SHM", shm)
    addr = f"tcp://127.0.0.1:{free_port()}"
    srv = Server(0, addr, timeout=2)
    t = threading.Thread(target=srv.serve, daemon=True)
    t.start()
    models = [torch.nn.Linear(3, 2) for _ in range(2)]
    clients = [Client([addr], w, 2, timeout=20) for w in range(2)]
    try:
        for c, m in zip(clients, models):
            c.register(m, optimizer="sgd", consistency="bsp", lr=0.1)
        ps, model = clients[0], models[0]
        ps.pull(model)
        model(torch.ones(1, 3)).sum().backward()
        ps.push(model)
        ps.clock()
        with pytest.raises(PSError, match=r"waited 2s at clock 1 for workers \[1\] \(at clocks \[0\]\).*"
                                            r"in BSP a missing worker holds everyone back"):
            ps.pull(model)
    finally:
        for c in clients:
            c.close()
        srv.stopping = True
        t.join(5)
