"""``paratrain compare``: the same model and data under every strategy, side by side.

strategies.py: compare's strategy names, as ``paratrain train`` flags, and
whether each can run (train's own checks say why not). runs.py: each
strategy as an ordinary ``paratrain train`` run, one after another, from one
fork server. report.py: the rows from each run's folder, compare.md,
compare.json and compare.png. command.py: the CLI.
"""
