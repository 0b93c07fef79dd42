"""The same job under torchrun, for ``paratrain bench elastic``: PyTorch DDP over Gloo,
restarted whole from its last disk checkpoint when a worker dies (torchrun's policy).

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 4 --max-restarts 1 \\
        -m paratrain.bench.elastic_torchrun_worker CONFIG.json

The gpt task, Adam, batches from DistributedSampler; rank 0 saves a checkpoint
(model, optimizer, step) every ``commit_every`` steps, the usual way to survive a
restart, and every worker of a new attempt loads it and skips the batches of its
epoch already taken. It writes the same event lines as elastic_worker.py:
``start`` (with the attempt), ``kill``, ``step``, ``commit`` (the checkpoint's
seconds), and ``stopped``: when torchrun's agent told a survivor to stop
(SIGTERM), the moment it knew of the death.
"""
import itertools
import json
import os
import signal
import sys
import time

STARTED = time.time()


def main(path):
    import torch
    import torch.distributed as dist

    from paratrain.train.tasks import build_task
    cfg = json.loads(open(path).read())
    rank, attempt = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    out = open(cfg["events"], "a", buffering=1)

    def note(kind, **fields):
        out.write(json.dumps({"t": time.time(), "kind": kind, "worker": rank, "attempt": attempt, **fields}) + "\n")

    def stopped(signum, frame):
        note("stopped")
        os._exit(128 + signum)
    signal.signal(signal.SIGTERM, stopped)
    note("start", t_process=STARTED)
    task = build_task("gpt", seed=0)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    model = torch.nn.parallel.DistributedDataParallel(task.model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = 0
    if os.path.exists(cfg["checkpoint"]):
        saved = torch.load(cfg["checkpoint"], weights_only=True)
        model.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        step = int(saved["step"])
    sampler = torch.utils.data.DistributedSampler(task.train_set, seed=0, drop_last=True)
    per_epoch = len(task.train_set) // (world * cfg["batch"])
    kill = (cfg["kill_worker"], cfg["kill_step"])
    while step < cfg["steps"]:
        epoch, skip = divmod(step, per_epoch)
        sampler.set_epoch(epoch)
        loader = torch.utils.data.DataLoader(task.train_set, batch_size=cfg["batch"], sampler=sampler, drop_last=True)
        for batch in itertools.islice(loader, skip, per_epoch):
            if attempt == 0 and (rank, step + 1) == kill:
                note("kill", step=step + 1)
                out.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            opt.zero_grad()
            task.loss(model, batch).backward()
            opt.step()
            step += 1
            note("step", step=step, world=world)
            if step % cfg["commit_every"] == 0:
                t0 = time.perf_counter()
                if rank == 0:
                    tmp = cfg["checkpoint"] + ".tmp"
                    torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(), "step": step},
                               tmp)
                    os.replace(tmp, cfg["checkpoint"])
                dist.barrier()   # the checkpoint is on disk before anyone goes past it
                note("commit", seconds=time.perf_counter() - t0)
            if step >= cfg["steps"]:
                break
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[-1])
