"""The built-in tasks: their data, models, losses and evaluations (paratrain.train.datasets/models/tasks)."""
import functools
import json
import sysconfig

import pytest
import torch
import torch.nn.functional as F

from paratrain.train import datasets
from paratrain.train.models import GPT, MLP, DigitsCNN
from paratrain.train.tasks import TASKS, build_task


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def params(model):
    return sum(p.numel() for p in model.parameters())


def linear_probe_accuracy(x, y, x_eval, y_eval, lr, steps):
    """Fit a linear classifier on (x, y) with Adam; its accuracy on the eval set."""
    torch.manual_seed(0)
    model = torch.nn.Linear(x.shape[1], int(y.max()) + 1)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    with torch.no_grad():
        return (model(x_eval).argmax(1) == y_eval).float().mean().item()


def same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# --- data ---------------------------------------------------------------------------------------

def test_digits_shapes_ranges_and_split():
    train, test = datasets.digits(test_fraction=0.2, seed=0)
    x, y = train.tensors
    xt, yt = test.tensors
    assert len(train) + len(test) == 1797 and len(test) == round(1797 * 0.2)
    assert x.shape == (len(train), 1, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert xt.shape[1:] == (1, 8, 8) and yt.dtype == torch.int64
    assert x.min() == 0 and x.max() == 1 and set(y.tolist()) == set(range(10))
    # disjoint: no image appears in both halves (the 1797 digits are all distinct images)
    all_x = torch.cat([x, xt]).flatten(1)
    assert torch.unique(all_x, dim=0).shape[0] == 1797


def test_digits_matches_sklearn_and_split_is_deterministic():
    from sklearn.datasets import load_digits
    d = load_digits()
    train, test = datasets.digits(seed=3)
    x = torch.cat([train.tensors[0], test.tensors[0]]).flatten(1).double() * 16
    y = torch.cat([train.tensors[1], test.tensors[1]])
    ref_x, ref_y = torch.from_numpy(d.data), torch.from_numpy(d.target)
    # same images with the same labels, only reordered
    key = lambda xs, ys: sorted(zip(map(tuple, xs.tolist()), ys.tolist()))
    assert key(x, y) == key(ref_x, ref_y)
    again, _ = datasets.digits(seed=3)
    other, _ = datasets.digits(seed=4)
    assert torch.equal(again.tensors[0], train.tensors[0]) and torch.equal(again.tensors[1], train.tensors[1])
    assert not torch.equal(other.tensors[1], train.tensors[1])


def test_synthetic_is_deterministic_shares_teacher_and_is_learnable():
    a = datasets.synthetic_classification(2048, dim=32, classes=4, seed=1, latent=8)
    b = datasets.synthetic_classification(2048, dim=32, classes=4, seed=1, latent=8)
    c = datasets.synthetic_classification(512, dim=32, classes=4, seed=2, latent=8)
    assert torch.equal(a.tensors[0], b.tensors[0]) and torch.equal(a.tensors[1], b.tensors[1])
    assert not torch.equal(a.tensors[0][:512], c.tensors[0])
    x, y = a.tensors
    assert x.shape == (2048, 32) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert abs(x.var().item() - 1) < 0.1
    counts = torch.bincount(y, minlength=4)
    assert counts.min() > 2048 / 4 / 3, counts  # every class present, none starved
    # a linear model fitted on a generalises to c (same teacher, other samples) far above chance
    xc, yc = c.tensors
    assert linear_probe_accuracy(x, y, xc, yc, lr=0.05, steps=200) > 0.8


def test_stdlib_text_is_sorted_stdlib_source_cut_at_max_bytes():
    import glob
    import os
    text = datasets.stdlib_text(max_bytes=10_000)
    assert len(text) == 10_000
    first = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[0]
    with open(first, "rb") as f:
        assert text.startswith(f.read()[:10_000])
    assert datasets.stdlib_text(max_bytes=20_000)[:10_000] == text


def test_stdlib_text_says_where_it_looked(monkeypatch, tmp_path):
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        datasets.stdlib_text()


@pytest.mark.parametrize("n, block, stride", [(100, 8, None), (100, 8, 3), (9, 8, 1), (8, 8, 1), (41, 8, 4), (1, 1, 1)])
def test_char_dataset_windows_are_shifted_slices(n, block, stride):
    data = bytes((7 * i + 3) % 256 for i in range(n))
    ds = datasets.CharDataset(data, block, stride)
    step = stride or block // 2
    expect = len(range(0, n - block, step))  # every start s with s + block + 1 <= n
    assert len(ds) == expect
    for i in range(len(ds)):
        x, y = ds[i]
        s = i * step
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (block,)
        assert x.tolist() == list(data[s:s + block]) and y.tolist() == list(data[s + 1:s + block + 1])
    with pytest.raises(IndexError):
        ds[len(ds)]
    if len(ds):  # the last window ends inside the data, and one more stride would not fit
        last = (len(ds) - 1) * step + block + 1
        assert last <= n < last + step


def test_char_dataset_bytes_beyond_ascii_and_loader():
    ds = datasets.CharDataset(bytes(range(256)) * 2, block_size=16)
    x, y = next(iter(torch.utils.data.DataLoader(ds, batch_size=4)))
    assert x.shape == y.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    assert int(ds[len(ds) - 1][1].max()) <= 255


def test_masked_text_hides_15_percent_the_same_way_every_time():
    windows = datasets.CharDataset(bytes(range(32, 127)) * 4, block_size=40)
    masked = datasets.MaskedText(windows, mask_id=1)
    assert len(masked) == len(windows)
    for i in range(len(masked)):
        x, y = masked[i]
        original = windows[i][0]
        chosen = y != -100
        assert int(chosen.sum()) == 6                            # round(0.15 * 40)
        assert torch.equal(y[chosen], original[chosen])          # the targets are the hidden bytes
        assert torch.equal(x[~chosen], original[~chosen])        # only chosen positions change
        assert torch.equal(x, masked[i][0]) and torch.equal(y, masked[i][1])
    xs = torch.stack([masked[i][0] for i in range(len(masked))])
    ys = torch.stack([masked[i][1] for i in range(len(masked))])
    assert (xs[ys != -100] == 1).float().mean() > 0.6              # most chosen positions hold the mask
    assert not torch.equal(ys[0] != -100, ys[1] != -100)           # each window its own positions


def test_text_splits_by_position():
    train, val = datasets.text_splits(block_size=32, max_bytes=50_000, val_fraction=0.1)
    text = datasets.stdlib_text(50_000)
    cut = int(len(text) * 0.9)
    assert bytes(train.data.tolist()) == text[:cut] and bytes(val.data.tolist()) == text[cut:]
    assert len(train) == (cut - 33) // 16 + 1


# --- models -------------------------------------------------------------------------------------

def test_mlp_sizes_and_flattening():
    assert params(MLP([784, 512, 512, 10])) == 784 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10
    m = MLP([4, 3, 2])
    assert [type(l).__name__ for l in m.layers] == ["Linear", "ReLU", "Linear"]
    assert m(torch.zeros(5, 1, 2, 2)).shape == (5, 2)


def test_digits_cnn_shape():
    assert DigitsCNN()(torch.zeros(3, 1, 8, 8)).shape == (3, 10)


def test_gpt_shape_and_parameter_count():
    V, T, L, H, C = 256, 16, 2, 2, 32
    m = GPT(V, T, L, H, C)
    assert m(torch.randint(0, V, (3, T))).shape == (3, T, V)
    assert m(torch.randint(0, V, (2, 5))).shape == (2, 5, V)
    block = 2 * 2 * C + (3 * C * C + 3 * C) + (C * C + C) + (4 * C * C + 4 * C) + (4 * C * C + C)
    assert params(m) == V * C + T * C + L * block + 2 * C + C * V
    assert params(GPT()) == 867_072
    with pytest.raises(ValueError, match="block_size"):
        m(torch.zeros(1, T + 1, dtype=torch.long))


def test_gpt_is_causal():
    torch.manual_seed(0)
    m = GPT(256, 16, 2, 2, 32).eval()
    idx = torch.randint(0, 256, (2, 16))
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    a, b = m(idx), m(changed)
    assert torch.equal(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_gpt_init_is_gpt2_like():
    torch.manual_seed(0)
    m = GPT()
    assert abs(m.tok_emb.weight.std().item() - 0.02) < 0.002
    assert abs(m.blocks[0].attn.proj.weight.std().item() - 0.02 / (2 * 4) ** 0.5) < 0.001
    assert all(not torch.any(b.attn.qkv.bias) for b in m.blocks)


@pytest.mark.parametrize("make", [lambda: MLP([8, 6, 3]), DigitsCNN, lambda: GPT(256, 8, 1, 2, 16)])
def test_models_depend_only_on_seed(make):
    torch.manual_seed(5)
    a = make()
    torch.manual_seed(5)
    b = make()
    torch.manual_seed(6)
    c = make()
    assert same_weights(a, b) and not same_weights(a, c)


# --- tasks --------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def recsys_task():
    """The recsys task, built once for the tests that only read it (its 1M-row table takes seconds)."""
    return build_task("recsys", seed=0)


@pytest.mark.parametrize("name", TASKS)
def test_build_task(name):
    task = recsys_task() if name == "recsys" else build_task(name, seed=0)
    assert task.name == name and task.metric in ("accuracy", "eval_loss")
    d = task.defaults
    assert {"steps", "batch_size", "lr", "optimizer", "eval_every"} <= d.keys() and d["optimizer"] in ("sgd", "adam")
    assert json.loads(json.dumps(task.config)) == task.config and task.config["name"] == name
    assert len(task.train_set) >= 2 * d["batch_size"]  # two workers get at least one step per epoch
    batch = torch.utils.data.default_collate([task.train_set[i] for i in range(4)])
    loss = task.loss(task.model, batch)
    assert loss.shape == () and loss.requires_grad
    # an untrained model is at chance: loss near ln(number of classes)
    n_out = 256 if name == "gpt" or name.startswith("hf-") else {"recsys": 2}.get(name, 10)   # recsys: click or not
    assert abs(loss.item() - torch.log(torch.tensor(float(n_out))).item()) < 0.3
    task.model.train()
    result = task.evaluate(task.model)
    assert task.model.training
    assert task.metric in result and "eval_loss" in result
    assert result == task.evaluate(task.model)


def test_build_task_seed_sets_weights_not_data():
    a, b, c = build_task("digits", 1), build_task("digits", 1), build_task("digits", 2)
    assert same_weights(a.model, b.model) and not same_weights(a.model, c.model)
    assert torch.equal(a.eval_set.tensors[1], c.eval_set.tensors[1])


def test_mlp_eval_set_poses_the_training_problem():
    """The benchmark task's eval samples are new but labelled by the same teacher: a linear
    model fitted to the training set scores far above chance on them."""
    task = build_task("mlp")
    x, y = task.train_set.tensors
    xe, ye = task.eval_set.tensors
    assert not torch.equal(x[:len(xe)], xe)
    assert linear_probe_accuracy(x, y, xe, ye, lr=0.01, steps=40) > 0.5


def test_recsys_ids_are_zipf_and_a_batch_touches_few_rows():
    from paratrain.ps.rows import initial_rows
    from paratrain.train import recsys
    task = recsys_task()
    ids = task.train_set.tensors[0]
    counts = torch.bincount(ids.reshape(-1), minlength=recsys.NUM_IDS).sort(descending=True).values
    top = counts[:recsys.NUM_IDS // 100].sum().item() / counts.sum().item()
    assert top > 0.5          # Zipf 1.05: the most common 1% of ids carry most of the lookups
    assert torch.unique(ids[:64]).numel() < 64 * recsys.FIELDS   # a batch repeats hot ids
    rows = torch.tensor([0, 12345, 999_999])   # the dense table starts where the servers' rows do
    want = initial_rows(recsys.SEED, 0, rows.numpy(), recsys.DIM, recsys.INIT_STD)
    assert torch.equal(task.model.emb.weight[rows].detach(), torch.from_numpy(want))
    sparse = build_task("recsys", sparse=True)
    assert sparse.model.emb.num_embeddings == recsys.NUM_IDS and sparse.config["sparse"]
    assert sum(p.numel() for p in sparse.model.parameters()) < 50_000   # the table is not in the process


def test_unknown_task_names_choices():
    with pytest.raises(ValueError, match="unknown model 'nope'; choose from digits, gpt, mlp, mlp-large"):
        build_task("nope")


def test_loss_is_cross_entropy():
    task = build_task("digits")
    x, y = task.train_set.tensors[0][:16], task.train_set.tensors[1][:16]
    assert torch.allclose(task.loss(task.model, (x, y)), F.cross_entropy(task.model(x), y))
    gpt = build_task("gpt")
    x, y = torch.utils.data.default_collate([gpt.train_set[i] for i in (0, 5)])
    logits = gpt.model(x)
    by_hand = torch.stack([F.cross_entropy(logits[b, t], y[b, t]) for b in range(2) for t in range(64)]).mean()
    assert torch.allclose(gpt.loss(gpt.model, (x, y)), by_hand, atol=1e-6)


def test_evaluate_matches_a_hand_count():
    task = build_task("digits")
    x, y = task.eval_set.tensors
    with torch.no_grad():
        logits = task.model(x)
    r = task.evaluate(task.model)
    assert r["accuracy"] == (logits.argmax(1) == y).sum().item() / len(y)
    assert abs(r["eval_loss"] - F.cross_entropy(logits, y).item()) < 1e-5


def test_short_digits_training_learns():
    """150 steps of the digits task's defaults (batch x 2, as for two workers) lift test accuracy from
    chance to well above it: loss, data and evaluate are wired to each other."""
    task = build_task("digits", seed=0)
    d = task.defaults
    before = task.evaluate(task.model)["accuracy"]
    opt = torch.optim.SGD(task.model.parameters(), lr=d["lr"], momentum=0.9)
    loader = torch.utils.data.DataLoader(task.train_set, batch_size=2 * d["batch_size"], shuffle=True,
                                         drop_last=True, generator=torch.Generator().manual_seed(0))
    step = 0
    while step < 150:
        for batch in loader:
            opt.zero_grad()
            task.loss(task.model, batch).backward()
            opt.step()
            step += 1
            if step == 150:
                break
    after = task.evaluate(task.model)
    assert before < 0.2 and after["accuracy"] > 0.9, (before, after)


def test_hf_models_name_their_families_and_untie_on_request():
    from paratrain.train import hf_models
    with pytest.raises(ValueError, match="choose from gpt2, bert, llama"):
        hf_models.build("gpt3")
    tied, untied = hf_models.build("gpt2", layers=1), hf_models.build("gpt2", tied=False, layers=1)
    assert tied.lm_head.weight is tied.transformer.wte.weight
    assert untied.lm_head.weight is not untied.transformer.wte.weight
    assert hf_models.build("llama", layers=1).model.layers[0].self_attn.k_proj.out_features == 32   # 2 of 4 heads


@pytest.mark.parametrize("name", ["digits", "mlp", "gpt"])
def test_the_trainer_s_batches_are_the_data_loader_s_to_the_bit(name):
    """A dataset of tensors in memory is batched by one gather a tensor, not sample by sample:
    the same batches, in the same order, each epoch's (a rank's shard, set_epoch's shuffle),
    and from a step inside an epoch as a resumed run starts."""
    import itertools

    import paratrain as pt
    from paratrain.train.trainer import batches_from, epoch_batches, epoch_batches_naive
    task = build_task(name)
    sampler = pt.DistributedSampler(task.train_set, num_replicas=2, rank=1, seed=3)
    per_epoch = len(task.train_set) // (2 * 16)
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        fast = list(itertools.islice(epoch_batches(task.train_set, sampler, 16), 300))
        naive = list(itertools.islice(epoch_batches_naive(task.train_set, sampler, 16), 300))
        assert len(fast) == len(naive) == min(per_epoch, 300)
        for a, b in zip(fast, naive):
            assert type(a) is type(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))
    start = per_epoch + 5   # the sixth step of the second epoch
    (step, batch), = itertools.islice(batches_from(task, sampler, 16, start, per_epoch), 1)
    sampler.set_epoch(1)
    assert step == start and all(torch.equal(x, y) for x, y in zip(batch, naive[5]))
