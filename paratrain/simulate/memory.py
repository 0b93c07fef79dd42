"""What a worker holds, predicted: the training state each strategy keeps, and activations.

The state (Rajbhandari et al., "ZeRO", arXiv 1910.02054, sec. 3: fp32
parameters 4 bytes, gradients 4, optimizer state K: Adam's two moments 8,
SGD's momentum 4), divided as each strategy divides it:

- dp, dp-naive: all of it, (8 + K) P; top-k and PowerSGD add their residuals
  (error feedback, 4 P; inside a tensor group of t, 4 P / t: its shard's);
- ZeRO: stage 1 4P + 4P + KP/N, stage 2 4P + (4 + K)P/N, stage 3 (8 + K)P/N;
- a pipeline of p stages, a tensor group of t: (8 + K)P/p, (8 + K)P/t;
- a parameter-server worker: parameters and gradients (the optimizer is on
  the servers), 8 P.

Activations, those backward keeps: for a transformer block (Korthikanti et
al., arXiv 2205.05198, sec. 4.1, there in 16-bit) 34 s b h + 5 a s^2 b
bytes, twice that in fp32, per layer, for micro-batch b, sequence s, width h
and a heads; for other models, a layer's output as measured (here.py), or 4
bytes a sample per layer of width h. A
pipeline stage holds its layers' activations for as many micro-batches as
its schedule keeps in flight (1F1B: p); a tensor group cuts them by t.
"""
ADAM, SGD_MOMENTUM = 8, 4
MB = 1 << 20


def state_bytes(strategy, P, K, workers, pp=1, tp=1, compression=None):
    """Bytes of training state a worker holds (above); ``compression``: a tensor group's
    replicas compressing their gradients, with a residual of the shard's size."""
    if strategy.startswith("zero"):
        stage = int(strategy[-1])
        return {1: 8 * P + K * P / workers, 2: 4 * P + (4 + K) * P / workers, 3: (8 + K) * P / workers}[stage]
    if strategy.startswith("ps-"):
        return 8 * P
    whole = (8 + K) * P / (pp * tp)
    return whole + (4 * P / (pp * tp) if strategy in ("topk", "powersgd") or compression else 0)


def activation_bytes(workload, samples, heads=None, layers=None):
    """Activations backward keeps for ``samples`` samples through ``layers`` layers."""
    layers = layers if layers is not None else (workload.layers or 1)
    h, s = workload.hidden or 0, workload.seq_len or 1
    if heads:   # a transformer block, fp32
        per_layer = 2 * (34 * s * samples * h + 5 * heads * s * s * samples)
    elif workload.activation_bytes:   # measured (here.py): a layer's output for the workload's batch
        per_layer = workload.activation_bytes * samples / workload.batch_per_device
    else:
        per_layer = 4 * samples * h
    return layers * per_layer
