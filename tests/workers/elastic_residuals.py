"""Elastic data parallelism with top-k compression: 3 workers, worker 1 dies as it begins
step 7. Every worker saves its compressor's state after each commit and after the
re-form into DIR, so tests/test_elastic.py can check that each survivor starts again
from the mean of the three committed states (the dead worker's from its buddy's copy)."""
import os
import signal
import sys

import torch

import paratrain as pt
from paratrain.parallel.compression import TopK

sys.path.insert(0, __file__.rsplit("/", 2)[0])   # tests/: the data and model both sides use
from test_elastic import BATCH, COMMIT_EVERY, data, make_model

pt.init()
me, out = int(os.environ["PARATRAIN_ELASTIC"]), os.environ["DIR"]
X, y = data()
dataset = torch.utils.data.TensorDataset(X, y)
compressor = TopK(0.1)
model = pt.DataParallel(make_model(), compression=compressor)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
sampler = pt.elastic.ElasticSampler(dataset, shuffle=True, seed=0, batch_size=BATCH)
state = pt.elastic.State(model=model, optimizer=opt, sampler=sampler, epoch=0, step=0)


@state.on_reset
def saved_after_the_change(state):
    torch.save(compressor.state_dict(), f"{out}/after-w{me}.pt")


@pt.elastic.run
def train(state):
    state.sampler.set_epoch(0)
    for xb, yb in torch.utils.data.DataLoader(dataset, batch_sampler=state.sampler):
        if (me, state.step + 1) == (1, 7):
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xb), yb).backward()
        opt.step()
        state.step += 1
        if state.step % COMMIT_EVERY == 0:
            state.commit()
            torch.save(compressor.state_dict(), f"{out}/c{state.step}-w{me}.pt")
        if state.step == 12:
            return


train(state)
pt.destroy()
