"""The built-in tasks of ``paratrain train``: a model, its data, its loss and its evaluation.

A Task is everything the trainer needs to know about *what* it trains, so the
trainer itself only knows *how* (strategy, optimizer, steps, checkpoints).
Each task builds its model right after ``torch.manual_seed(seed)``, so every
worker builds the same initial weights on its own; its data do not depend on
the seed (only the sampling order, which the trainer draws, does), so runs
with different seeds are scored on the same evaluation set.

    digits      DigitsCNN on scikit-learn's 8x8 digits; headline: test accuracy
    gpt         a 0.87M-parameter GPT on the Python standard library's source; headline: eval loss
    mlp         MLP 784-512-512-10 (0.67M) on synthetic data; the small benchmark model
    mlp-large   MLP 784-3072x3-10 (21M) on the same data; the large benchmark model
    recsys      click prediction with a 1M x 64 embedding table and Zipf ids (recsys.py); sparse rows
                on the parameter servers with --strategy ps, a dense table otherwise
    hf-gpt2     Hugging Face GPT-2 (tied embeddings, fused q/k/v in Conv1D) on the same text; eval loss
    hf-llama    Hugging Face Llama (grouped-query attention, rotary positions) on the same text; eval loss
    hf-bert     Hugging Face BERT, masked language modelling on the same text; eval loss of the masked bytes

The hf-* models are built from small configs with random weights (hf_models.py;
``pip install -e '.[hf]'``), wrapped so they take token ids and return logits.
"""
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import datasets
from .models import GPT, MLP, DigitsCNN

HF_TASKS = {"hf-gpt2": "gpt2", "hf-bert": "bert", "hf-llama": "llama"}
TASKS = ("digits", "gpt", "mlp", "mlp-large", "recsys", *HF_TASKS)


@dataclass
class Task:
    name: str
    model: nn.Module
    train_set: torch.utils.data.Dataset   # indexable; items are tuples of tensors
    eval_set: torch.utils.data.Dataset
    loss: Callable[[nn.Module, tuple], torch.Tensor]   # loss(model, batch) -> mean loss over the batch
    evaluate: Callable[[nn.Module], dict]               # evaluate(model) -> {"accuracy"?, "eval_loss"}
    defaults: dict   # steps, batch_size (per worker), lr, optimizer ("sgd" or "adam"), eval_every
    config: dict     # JSON description of the architecture, compared on checkpoint resume
    metric: str      # the headline metric: "accuracy" or "eval_loss"
    tensor_plan: Callable[[nn.Module], dict] = None   # plan(model) -> its pt.tensor plan; None: no --tp
    blocks: str = None   # the path of the model's transformer blocks (a ModuleList), for per-layer figures


def classification_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def next_token_loss(model, batch):
    """Cross-entropy of every position's prediction of the next byte, averaged over batch and positions
    (for masked bytes: over the positions whose target is not -100, cross-entropy's ignore_index)."""
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def _evaluating(fn):
    """Run fn(model) under no_grad in eval mode, and put the model's mode back afterwards
    (evaluate is called in the middle of training)."""
    def evaluate(model):
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                return fn(model)
        finally:
            model.train(was_training)
    return evaluate


def classification_eval(dataset, chunk=512):
    """evaluate(model) -> accuracy and mean cross-entropy over the whole of dataset, in chunks."""
    x_all, y_all = dataset.tensors

    def run(model):
        correct, loss = 0, 0.0
        for i in range(0, len(y_all), chunk):
            x, y = x_all[i:i + chunk], y_all[i:i + chunk]
            logits = model(x)
            loss += F.cross_entropy(logits, y, reduction="sum").item()
            correct += (logits.argmax(1) == y).sum().item()
        return {"accuracy": correct / len(y_all), "eval_loss": loss / len(y_all)}
    return _evaluating(run)


def text_eval(dataset, windows=128):
    """evaluate(model) -> mean next-byte cross-entropy over `windows` validation windows
    spread evenly over the validation text.

    The whole validation set (thousands of windows) is too slow to score at
    every evaluation; the same fixed windows every time keep successive
    evaluations comparable, and spreading them out samples many files rather
    than one.
    """
    n = min(windows, len(dataset))
    index = torch.linspace(0, len(dataset) - 1, n).round().long().tolist()
    x = torch.stack([dataset[i][0] for i in index])
    y = torch.stack([dataset[i][1] for i in index])

    def run(model):
        return {"eval_loss": next_token_loss(model, (x, y)).item()}
    return _evaluating(run)


def _digits(seed):
    train, test = datasets.digits(test_fraction=0.2, seed=0)
    torch.manual_seed(seed)
    model = DigitsCNN()
    return Task(
        name="digits", model=model, train_set=train, eval_set=test,
        loss=classification_loss, evaluate=classification_eval(test),
        defaults={"steps": 500, "batch_size": 32, "lr": 0.05, "optimizer": "sgd", "eval_every": 50},
        config={"name": "digits", "model": "DigitsCNN", "input": [1, 8, 8], "classes": 10},
        metric="accuracy")


def _gpt(seed):
    arch = {"vocab_size": 256, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 128}
    train, val = datasets.text_splits(block_size=arch["block_size"], max_bytes=2_000_000)
    torch.manual_seed(seed)
    model = GPT(**arch)
    return Task(
        name="gpt", model=model, train_set=train, eval_set=val,
        loss=next_token_loss, evaluate=text_eval(val),
        defaults={"steps": 300, "batch_size": 16, "lr": 1e-3, "optimizer": "adam", "eval_every": 50},
        config={"name": "gpt", "model": "GPT", **arch},
        metric="eval_loss", tensor_plan=_gpt_plan, blocks="blocks")


def _gpt_plan(model):
    from ..parallel.tensor import GPT_PLAN
    return GPT_PLAN


def _plan_for(model):
    from ..parallel.tensor import plan_for
    return plan_for(model)


HF_SIZES = {"vocab": 256, "positions": 64, "width": 128, "heads": 4, "kv_heads": 2, "layers": 4, "mlp": 512}
HF_BLOCKS = {"gpt2": "hf.transformer.h", "bert": "hf.bert.encoder.layer", "llama": "hf.model.layers"}


def _hf(name, seed):
    """A small Hugging Face model of the family on the stdlib text: next-byte
    prediction for the causal ones, masked bytes for BERT."""
    from . import hf_models
    family = HF_TASKS[name]
    train, val = datasets.text_splits(block_size=HF_SIZES["positions"], max_bytes=2_000_000)
    if family == "bert":
        train, val = datasets.MaskedText(train), datasets.MaskedText(val)
    torch.manual_seed(seed)
    hf = hf_models.build(family, **HF_SIZES)
    return Task(
        name=name, model=hf_models.LogitsOf(hf), train_set=train, eval_set=val,
        loss=next_token_loss, evaluate=text_eval(val),
        defaults={"steps": 300, "batch_size": 16, "lr": 1e-3, "optimizer": "adam", "eval_every": 50},
        config={"name": name, "model": type(hf).__name__, "tied": bool(hf.config.tie_word_embeddings), **HF_SIZES},
        metric="eval_loss", tensor_plan=_plan_for, blocks=HF_BLOCKS[family])


def _mlp(name, sizes, defaults, seed):
    # Train and eval sets differ in samples (seed) but share the teacher, so eval measures generalisation.
    train = datasets.synthetic_classification(8192, dim=sizes[0], classes=sizes[-1], seed=1)
    test = datasets.synthetic_classification(1024, dim=sizes[0], classes=sizes[-1], seed=2)
    torch.manual_seed(seed)
    model = MLP(sizes)
    return Task(
        name=name, model=model, train_set=train, eval_set=test,
        loss=classification_loss, evaluate=classification_eval(test),
        defaults=defaults, config={"name": name, "model": "MLP", "sizes": list(sizes)}, metric="accuracy")


def _recsys(seed, sparse):
    from . import recsys
    train, test = recsys.click_data()
    torch.manual_seed(seed)
    embedding = recsys.make_embedding(sparse)
    model = recsys.ClickModel(embedding)
    return Task(
        name="recsys", model=model, train_set=train, eval_set=test,
        loss=recsys.click_loss, evaluate=recsys.click_eval(test),
        defaults={"steps": 1000, "batch_size": 64, "lr": 3e-3, "optimizer": "adam", "eval_every": 200},
        config={"name": "recsys", "model": "ClickModel", "ids": recsys.NUM_IDS, "dim": recsys.DIM,
                "fields": recsys.FIELDS, "sparse": bool(sparse)},
        metric="eval_loss")


def build_task(name, seed=0, sparse=False):
    """The task called name, its model initialised from seed. sparse: recsys keeps its
    embedding rows on the parameter servers (pt.ps.Embedding) instead of in the model."""
    if name == "recsys":
        return _recsys(seed, sparse)
    if name == "digits":
        return _digits(seed)
    if name == "gpt":
        return _gpt(seed)
    if name in HF_TASKS:
        return _hf(name, seed)
    if name == "mlp":
        return _mlp(name, [784, 512, 512, 10],
                    {"steps": 200, "batch_size": 64, "lr": 0.02, "optimizer": "sgd", "eval_every": 50}, seed)
    if name == "mlp-large":
        return _mlp(name, [784, 3072, 3072, 3072, 10],
                    {"steps": 100, "batch_size": 32, "lr": 0.01, "optimizer": "sgd", "eval_every": 50}, seed)
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(TASKS)}")
