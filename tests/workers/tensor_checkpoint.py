"""Worker: a tensor-parallel checkpoint written at one TP size resumes at another.

    tensor_checkpoint.py save PATH    (TP = the world size: one Adam step, then the
                                       gathered model and optimizer state to PATH)
    tensor_checkpoint.py load PATH    (another TP size: PATH resliced, checked against
                                       one process after the same step, then one more
                                       step on both, still equal)
"""
import sys

import torch
import torch.nn.functional as F

import paratrain as pt

torch.set_default_dtype(torch.float64)
ARCH = dict(vocab_size=36, block_size=12, n_layer=2, n_head=6, n_embd=24)   # cut 2 or 3 ways
TOL = 1e-10


def batch(k):
    gen = torch.Generator().manual_seed(20 + k)
    return torch.randint(0, 36, (4, 12), generator=gen), torch.randint(0, 36, (4, 12), generator=gen)


def step(model, opt, k):
    x, y = batch(k)
    F.cross_entropy(model(x).reshape(-1, 36), y.reshape(-1)).backward()
    opt.step()
    opt.zero_grad()


def close_all(got, want, what):
    assert set(got) == set(want), what
    for k in want:
        a, b = got[k], want[k]
        if torch.is_tensor(b):
            err = float((a - b).abs().max()) if b.numel() else 0.0
            assert err <= TOL * max(1.0, float(b.abs().max())), f"{what} {k}: off by {err:.3e}"


def gathered(model, opt):
    full_opt = pt.tensor.full_optimizer_state(model, opt)
    return pt.tensor.full_state_dict(model), {i: s for i, s in full_opt["state"].items()}


def main():
    from paratrain.train.models import GPT
    mode, path = sys.argv[1], sys.argv[2]
    g = pt.init()
    if mode == "save":
        torch.manual_seed(0)
        model = pt.tensor.parallelize(GPT(**ARCH), group=g, plan=pt.tensor.GPT_PLAN)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        step(model, opt, 0)
        state = {"model": pt.tensor.full_state_dict(model), "optimizer": pt.tensor.full_optimizer_state(model, opt)}
        if g.rank == 0:
            torch.save(state, path)
    else:
        torch.manual_seed(0)
        ref = GPT(**ARCH)
        ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
        step(ref, ref_opt, 0)
        torch.manual_seed(1)   # other weights: all must come from the file
        model = pt.tensor.parallelize(GPT(**ARCH), group=g, plan=pt.tensor.GPT_PLAN)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        saved = torch.load(path, weights_only=True)
        pt.tensor.load_full_state_dict(model, saved["model"])
        pt.tensor.load_full_optimizer_state(model, opt, saved["optimizer"])
        for when in ("resumed", "one step later"):
            params, moments = gathered(model, opt)
            close_all(params, ref.state_dict(), f"{when}: parameter")
            for i, entries in ref_opt.state_dict()["state"].items():
                close_all(moments[i], entries, f"{when}: Adam state of parameter {i}:")
            step(model, opt, 1)
            step(ref, ref_opt, 1)
    print(f"tensor checkpoint {mode} passed on rank {g.rank}", flush=True)
    pt.destroy()


if __name__ == "__main__":
    sys.exit(main())
