"""Benchmarks that answer "is paratrain's engine worth having?" by measuring it
beside the proven engines in the same run.

    paratrain bench collectives -n 2     collectives.py: shm vs Gloo vs Open MPI, nccl-tests style

Nothing is imported here: ``python -m paratrain.bench.collectives`` starts the
workers, and importing that module from this package first would make runpy
warn that it is already loaded.
"""
