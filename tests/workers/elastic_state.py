"""Rank 1's commit (a trained model, Adam with its moments) to every rank by State.sync;
rank 0 and 2 start untrained (rank 2's Adam has no state at all)."""
import sys

sys.path.insert(0, __file__.rsplit("/", 2)[0])   # tests/: test_elastic_state's helpers
import paratrain as pt
from test_elastic_state import digest, model_and_adam

g = pt.init()
model, opt = model_and_adam(seed=g.rank, steps={0: 1, 1: 4, 2: 0}[g.rank])
state = pt.elastic.State(model=model, optimizer=opt, epoch=g.rank, step=10 * g.rank)
if g.rank == 1:
    print("root digest", digest(model, opt), flush=True)
state.sync(g, root=1)
assert (state.epoch, state.step) == (1, 10), (state.epoch, state.step)
print("synced digest", digest(model, opt), flush=True)
pt.destroy()
