"""Tensor parallelism: layers cut inside, across a group.

    import paratrain as pt
    h = pt.tensor.ColumnParallelLinear(512, 2048, group=g)(x)      # layers.py
    y = pt.tensor.RowParallelLinear(2048, 512, group=g)(F.gelu(h))
    pt.functional.all_reduce(t, g)                                # functional.py: differentiable collectives
    pt.tensor.parallelize(model, group=g, plan=pt.tensor.GPT_PLAN)  # plan.py: shard a model's layers in place
    pt.tensor.parallelize(hf, group=g, plan=pt.tensor.plan_for(hf))  # families.py: GPT-2, BERT, Llama and kin
"""
from . import functional
from .layers import ColumnParallelLinear, RowParallelLinear
from .checkpoint import full_optimizer_state, full_state_dict, load_full_optimizer_state, load_full_state_dict
from .families import plan_for
from .plan import GPT_PLAN, check_plan, parallelize
from .functional import traffic
from .vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy

__all__ = ["ColumnParallelLinear", "GPT_PLAN", "check_plan", "RowParallelLinear", "VocabParallelEmbedding", "full_optimizer_state",
           "full_state_dict", "functional", "load_full_optimizer_state", "load_full_state_dict", "parallelize", "plan_for", "traffic", "vocab_parallel_cross_entropy"]
