"""A step's timeline: what each stage did when, the bubble measured, and a picture of it.

``Pipeline.timeline`` holds this rank's actions of the last step as (kind,
microbatch, chunk, start, end), seconds from the step's start, each start
taken once the action's input had arrived. ``gather`` brings every stage's to
one rank (as numbers: kind 0/1/2 for F/B/W); ``bubble`` is the idle share of
the stages' time, p x the step's span; ``plot`` draws one row per stage with a
box per action, F / B / W in their own colours and the idle gaps left white.
"""
import torch

KINDS = "FBW"
COLOURS = {"F": "#4C72B0", "B": "#55A868", "W": "#C44E52"}


def gather(group, timeline):
    """Every rank's timeline, on every rank of ``group`` (all have the same number of actions)."""
    mine = torch.tensor([[KINDS.index(k), mb, c, s, e] for k, mb, c, s, e in timeline], dtype=torch.float64)
    every = torch.zeros(group.world_size * mine.numel(), dtype=torch.float64)
    group.all_gather(every, mine.reshape(-1))
    rows = every.view(group.world_size, -1, 5).tolist()
    return [[(KINDS[int(k)], int(mb), int(c), s, e) for k, mb, c, s, e in rank] for rank in rows]


def bubble(timelines):
    """1 - (time spent in actions) / (stages x the step's span)."""
    span = max(e for t in timelines for *_, e in t) - min(s for t in timelines for *_, s, _ in t)
    busy = sum(e - s for t in timelines for *_, s, e in t)
    return 1.0 - busy / (len(timelines) * span) if span > 0 else 0.0


def plot(timelines, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    p = len(timelines)
    fig, ax = plt.subplots(figsize=(11, 0.6 * p + 2.0))
    for r, actions in enumerate(timelines):
        for kind, mb, chunk, s, e in actions:
            ax.broken_barh([(s * 1e3, (e - s) * 1e3)], (p - 1 - r - 0.4, 0.8), facecolors=COLOURS[kind],
                           edgecolor="white", linewidth=0.5)
            if (e - s) * 1e3 > 0.02 * max(x[-1] for x in actions) * 1e3:
                ax.text((s + e) / 2 * 1e3, p - 1 - r, f"{kind}{mb}" + (f".{chunk}" if chunk else ""),
                        ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"stage {p - 1 - r}" for r in range(p)])
    ax.set_xlabel("ms since the step began")
    ax.set_title(title, fontsize=10)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()] + [Patch(facecolor="white",
              edgecolor="grey", label="idle")], loc="upper center", bbox_to_anchor=(0.5, -0.3),
              fontsize=8, ncol=4, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
