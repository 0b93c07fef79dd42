"""``paratrain simulate``: a cost model of a training step, calibrated on this machine.

collectives.py: each collective's alpha-beta-gamma cost, by algorithm.
calibrate.py: alpha, beta and gamma fitted to measured times.
files.py: CLUSTER.toml and WORKLOAD.toml. data_parallel.py: a data-parallel
step, with the all-reduce overlapped with backward. command.py: the CLI.
"""
