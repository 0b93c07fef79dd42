"""Elastic data parallelism on a small regression: worker FAIL_WORKER dies by SIGKILL
as it begins step FAIL_STEP (after FAIL_STEP - 1 steps); the others re-form and
finish. FAIL=W:S:host: worker W's whole host hangs instead (SIGSTOP to the
launcher whose pid is in the file HOST_PID, then to itself: nothing closes). Rank 0 saves the final parameters to OUT (tests/test_elastic.py replays the
run in one process and compares)."""
import json
import os
import signal
import subprocess
import sys
import time

import torch

import paratrain as pt

sys.path.insert(0, __file__.rsplit("/", 2)[0])   # tests/: the data and model both sides use
from test_elastic import BATCH, COMMIT_EVERY, EPOCHS, data, make_model

pt.init()
fail_worker, fail_step, *how = os.environ.get("FAIL", "-1:-1").split(":")
fail_worker, fail_step = int(fail_worker), int(fail_step)
me = int(os.environ["PARATRAIN_ELASTIC"])
X, y = data()
dataset = torch.utils.data.TensorDataset(X, y)
model = pt.DataParallel(make_model())
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
sampler = pt.elastic.ElasticSampler(dataset, shuffle=True, seed=0, batch_size=BATCH)
state = pt.elastic.State(model=model, optimizer=opt, sampler=sampler, epoch=0, step=0)
sizes = []   # (step, world size) of every step this worker completed, redone ones included


@pt.elastic.run
def train(state):
    for state.epoch in range(state.epoch, EPOCHS):
        state.sampler.set_epoch(state.epoch)
        for xb, yb in torch.utils.data.DataLoader(dataset, batch_sampler=state.sampler):
            if (me, state.step + 1) == (fail_worker, fail_step):
                if how == ["cut"]:
                    print(f"worker {me}: cuts its host's link at {time.time():.3f}", flush=True)
                    subprocess.run(os.environ["CUT"].split(), check=True)
                else:
                    os.kill(os.getpid(), signal.SIGKILL)
            if pt.world().world_size < int(os.environ.get("SLOW_BELOW", "0")):
                time.sleep(0.25)   # time for a replacement to start and join
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(xb), yb).backward()
            opt.step()
            state.step += 1
            sizes.append((state.step, pt.world().world_size))
            if state.step % COMMIT_EVERY == 0:
                state.commit()
        assert state.sampler.used() == len(dataset), (state.sampler.used(), len(dataset))


train(state)
if pt.world().rank == 0:
    torch.save({k: v.clone() for k, v in model.module.state_dict().items()}, os.environ["OUT"])
    print("events", [(e["kind"], e["step"], e["was"], e["world_size"]) for e in state.events], flush=True)
    print("sizes", json.dumps(dict(sizes)), flush=True)
    print("why", [e["why"] for e in state.events], flush=True)   # each step's world size, as last run
pt.destroy()
