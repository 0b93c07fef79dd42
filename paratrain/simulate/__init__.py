"""``paratrain simulate``: a cost model of a training step, calibrated on this machine.

collectives.py: each collective's alpha-beta-gamma cost, by algorithm.
calibrate.py: alpha, beta and gamma fitted to measured times.
files.py: CLUSTER.toml and WORKLOAD.toml. step.py: a predicted step and its
parts. One file a strategy: data_parallel.py (buckets overlapped with
backward, and the naive wrapper), compressed.py (top-k, PowerSGD),
zero.py, pipeline.py (the engine's schedules, run with costs), tensor.py,
parameter_server.py; strategies.py names them as ``paratrain compare`` does.
command.py: the CLI.
"""
