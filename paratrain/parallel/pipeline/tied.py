"""Weights that several stages read: tied input and output embeddings.

GPT-2 and BERT use one matrix as the token embedding, read on the first
stage, and as the output projection, read on the last (Press & Wolf, "Using
the Output Embedding to Improve Language Models", EACL 2017). Cut into
stages, every stage that reads such a weight holds it, as Megatron-LM's first
and last stages each hold the word embedding (its embedding group,
``_allreduce_word_embedding_grads`` in
megatron/core/distributed/finalize_model_grads.py):

- the copies start equal: when the Pipeline is built, the first holder's
  value is copied to the others (ranks that built the model apart, from
  different seeds, still agree);
- after each step's backward, every holder's gradient becomes the sum of all
  holders' gradients, which is the gradient of the one weight of the whole
  model. Every copy then takes the same optimizer update and stays equal.

The sum travels point to point between the holders only (the first and last
stage: no group to form, no other rank waits), and every holder adds the
parts in the order of their ranks, so the copies' gradients are equal bit for
bit and so are the updates.
"""
import torch

from .transport import tied_tag


def shared(chunk_modules, model):
    """[(name, parameter, stages)] for each trainable parameter that several of the
    stages (``chunk_modules``, in order) read, in a fixed order."""
    names = {id(q): n for n, q in model.named_parameters()}
    readers = {}
    for s, module in enumerate(chunk_modules):
        for q in module.parameters():
            if q.requires_grad:
                readers.setdefault(id(q), (q, []))[1].append(s)
    return [(names.get(key, "?"), q, stages) for key, (q, stages) in readers.items() if len(stages) > 1]


def held(shared_params, rank, ranks):
    """This rank's part of ``shared``: [(name, parameter, holding ranks)] where the
    parameter's stages sit on several ranks, this one among them."""
    out = []
    for name, q, stages in shared_params:
        holders = sorted({s % ranks for s in stages})
        if len(holders) > 1 and rank in holders:
            out.append((name, q, holders))
    return out


@torch.no_grad()
def copy_from_first(group, tied, total):
    """Every holder's copy of each shared weight set to the first holder's."""
    works = []
    for i, (_, q, holders) in enumerate(tied):
        if group.rank == holders[0]:
            data = q.detach().contiguous()
            works += [(group.isend(data, r, tied_tag(total, i)), data) for r in holders[1:]]
    for i, (_, q, holders) in enumerate(tied):
        if group.rank != holders[0]:
            buf = torch.empty_like(q, memory_format=torch.contiguous_format)
            group.recv(buf, holders[0], tied_tag(total, i))
            q.copy_(buf)
    for work, _ in works:
        work.wait()


@torch.no_grad()
def sum_gradients(group, tied, total):
    """Each shared weight's gradient, on every holder, set to the sum of the holders'."""
    me, works, mine = group.rank, [], []
    for i, (_, q, holders) in enumerate(tied):
        g = (q.grad if q.grad is not None else torch.zeros_like(q)).contiguous()
        mine.append(g)
        works += [(group.isend(g, r, tied_tag(total, i)), g) for r in holders if r != me]
    sums = []
    for i, (_, q, holders) in enumerate(tied):
        parts = {me: mine[i]}
        for r in holders:
            if r != me:
                parts[r] = torch.empty_like(mine[i])
                group.recv(parts[r], r, tied_tag(total, i))
        summed = parts[holders[0]].clone()
        for r in holders[1:]:
            summed.add_(parts[r])
        sums.append(summed)
    for work, _ in works:
        work.wait()                  # (a gradient being sent is not overwritten)
    for (_, q, _), summed in zip(tied, sums):
        if q.grad is None:
            q.grad = summed
        else:
            q.grad.copy_(summed)
