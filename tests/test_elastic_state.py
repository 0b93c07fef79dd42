"""pt.elastic.State: a commit is a copy that restore() puts back exactly; sync() makes one
rank's commit every rank's, a rank whose Adam has no state yet included, with nothing
pickled on the way."""
import hashlib

import pytest
import torch

from conftest import launch

from paratrain.elastic import ElasticSampler, State
from paratrain.elastic.state import _flatten, _unflatten


def model_and_adam(seed=0, steps=3):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(16, 4)).square().mean().backward()
        opt.step()
    return model, opt


def digest(model, opt):
    h = hashlib.sha256()
    for v in model.state_dict().values():
        h.update(v.numpy().tobytes())
    for s in opt.state_dict()["state"].values():
        for v in s.values():
            h.update(v.numpy().tobytes() if torch.is_tensor(v) else repr(v).encode())
    return h.hexdigest()


def test_restore_puts_back_exactly_what_was_committed():
    model, opt = model_and_adam()
    sampler = ElasticSampler(range(100), seed=1, rank=0, num_replicas=2)
    state = State(model=model, optimizer=opt, sampler=sampler, epoch=2, step=30, note="x")
    before = digest(model, opt)
    next(iter(sampler)), next(iter(sampler))
    for _ in range(2):   # the run goes on past the commit...
        opt.zero_grad()
        model(torch.randn(16, 4)).sum().backward()
        opt.step()
    state.step, state.epoch = 31, 3
    assert digest(model, opt) != before
    state.restore()      # ...and comes back to it
    assert digest(model, opt) == before and (state.epoch, state.step, state.note) == (2, 30, "x")
    assert sampler.state_dict()["start"] == 0
    state.step += 1
    state.commit()
    assert state.commits == 2


def test_values_must_be_plain_and_missing_ones_say_so():
    state = State(epoch=0)
    with pytest.raises(TypeError, match="elastic State value 'model2' is a Linear"):
        State(model2=torch.nn.Linear(1, 1))
    with pytest.raises(AttributeError, match="holds no 'step'"):
        state.step


def test_the_description_and_tensors_rebuild_the_commit():
    model, opt = model_and_adam()
    saved = {"model": model.state_dict(), "optimizer": opt.state_dict(), "values": {"a": [1, 2.5, None],
                                                                                  "b": float("nan")}}
    meta, tensors = _flatten(saved)
    import json
    back = _unflatten(json.loads(json.dumps(meta)), tensors)
    assert back["optimizer"]["param_groups"] == saved["optimizer"]["param_groups"]
    assert set(back["optimizer"]["state"]) == set(saved["optimizer"]["state"])   # int keys stay ints
    assert back["values"]["a"] == [1, 2.5, None] and back["values"]["b"] != back["values"]["b"]
    for k, v in saved["model"].items():
        assert torch.equal(back["model"][k], v)


@pytest.mark.timeout(120)
def test_sync_gives_every_rank_the_roots_commit():
    res = launch(3, "elastic_state.py")
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    digests = [line.split()[-1] for line in res.stdout.splitlines() if "synced digest" in line]
    assert len(digests) == 3 and len(set(digests)) == 1, res.stdout
    assert "root digest " + digests[0] in res.stdout
