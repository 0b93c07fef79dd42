"""One worker of ``paratrain bench elastic``: the gpt task under pt.elastic and pt.DataParallel
(or pt.ZeRO, with ``zero`` in the config).

    paratrain run -n 4 --min-workers 2 [--max-restarts 1] -m paratrain.bench.elastic_worker CONFIG.json

Every worker appends JSON lines of what happened, with wall-clock times
(``time.time()``: one clock on one host), to ``events`` in the config:
``start`` (its process began), ``kill`` (the victim, just before SIGKILL),
``step`` (a step completed, its world size), ``commit`` (its seconds), and at
the end ``changed``, one per entry of ``state.events`` (``caught_at``: when
the broken world's error reached pt.elastic).
The driver (elastic.py) reads them back.

With ``cut`` in the config (a command), the victim, instead of dying, runs it:
it cuts its host's link, and goes on (nothing is closed, nothing reports a
death; elastic.py's --cut-link).
"""
import json
import os
import signal
import subprocess
import sys
import time

STARTED = time.time()


def main(path):
    import torch

    import paratrain as pt
    from paratrain.train.tasks import build_task
    cfg = json.loads(open(path).read())
    from paratrain import config
    me = config.get("PARATRAIN_ELASTIC")
    out = open(cfg["events"], "a", buffering=1)

    def note(kind, **fields):
        out.write(json.dumps({"t": time.time(), "kind": kind, "worker": me, **fields}) + "\n")
    note("start", t_process=STARTED)
    task = build_task("gpt", seed=0)   # before joining: a replacement builds while the others go on
    note("built")
    pt.init()
    note("joined")
    sampler = pt.elastic.ElasticSampler(task.train_set, shuffle=True, seed=0, batch_size=cfg["batch"])
    if cfg.get("zero"):   # the shards and their optimizer state, each with a copy on the next rank
        model = opt = pt.ZeRO(task.model, torch.optim.Adam, stage=cfg["zero"], lr=1e-3)
        state = pt.elastic.State(model=model, sampler=sampler, epoch=0, step=0)
    else:
        model = pt.DataParallel(task.model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        state = pt.elastic.State(model=model, optimizer=opt, sampler=sampler, epoch=0, step=0)
    kill = (cfg["kill_worker"], cfg["kill_step"])

    @pt.elastic.run
    def train(state):
        while state.step < cfg["steps"]:
            state.sampler.set_epoch(state.epoch)
            for batch in torch.utils.data.DataLoader(task.train_set, batch_sampler=state.sampler):
                if (me, state.step + 1) == kill:
                    note("kill", step=state.step + 1)
                    out.flush()
                    if cfg.get("cut"):
                        subprocess.run(cfg["cut"].split(), check=True)
                    else:
                        os.kill(os.getpid(), signal.SIGKILL)
                opt.zero_grad()
                task.loss(model, batch).backward()
                opt.step()
                state.step += 1
                note("step", step=state.step, world=pt.world().world_size)
                if state.step % cfg["commit_every"] == 0:
                    t0 = time.perf_counter()
                    state.commit()
                    note("commit", seconds=time.perf_counter() - t0)
                if state.step >= cfg["steps"]:
                    return
            state.epoch += 1
    train(state)
    for e in state.events:   # each change of world: when the error reached pt.elastic, how long re-forming took
        note("changed", **{("event" if k == "kind" else k): v for k, v in e.items()})
    pt.destroy()


if __name__ == "__main__":
    main(sys.argv[-1])
