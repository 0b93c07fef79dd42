"""Cut a row of layer costs into k consecutive runs with the cheapest most expensive run.

A pipeline step runs at the pace of its slowest stage, so the cut to find is
the one that minimises the largest stage cost: the linear partition problem
(Skiena, "The Algorithm Design Manual", sec. 8.5). Two versions side by side:

- ``balance_greedy``: walk the layers and start a new stage once the current
  one reaches total / k. Simple; can leave the last stage far too heavy.
- ``balance``: dynamic programming over (layers so far, stages used), exact,
  O(k n^2) for n layers: instant for the tens of layers a model has.
"""


def balance_greedy(costs, k):
    target = sum(costs) / k
    starts, acc = [0], 0.0
    for i, c in enumerate(costs):
        if acc >= target and len(starts) < k and i > starts[-1]:
            starts.append(i)
            acc = 0.0
        acc += c
    while len(starts) < k:   # too few cuts: split the tail layer by layer
        starts.append(starts[-1] + 1)
    return starts


def balance(costs, k):
    """Start index of each of the k runs (starts[0] == 0), every run non-empty, the
    largest run sum as small as possible; ties go to the earliest cut."""
    n = len(costs)
    if not 1 <= k <= n:
        raise ValueError(f"cannot cut {n} layers into {k} non-empty stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[j][i]: the smallest possible largest run when the first i layers form j runs
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            for s in range(j - 1, i):
                worst = max(best[j - 1][s], prefix[i] - prefix[s])
                if worst < best[j][i]:
                    best[j][i], cut[j][i] = worst, s
    starts, i = [], n
    for j in range(k, 0, -1):
        i = cut[j][i]
        starts.append(i)
    return starts[::-1]
