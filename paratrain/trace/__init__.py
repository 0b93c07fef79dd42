"""pt.trace: see a distributed run, one timeline across ranks.

    paratrain train --trace                    # runs/<id>/trace.json and trace.png
    paratrain run --trace DIR script.py        # DIR/trace.json (also PARATRAIN_TRACE=DIR)
    with pt.trace.span("my part"): ...         # the user's own spans, on this rank's row
    with pt.trace.label("my layer"): ...       # what the collectives inside are for
    paratrain trace runs/<id>                  # where each rank's time went, and who was late

Each process records its spans to its own file (recorder.py) on a clock
whose offset to rank 0's it measured at start-up (clock.py); every
collective and message of comm/ is recorded with its group and sequence id
(calls.py). At the end the files are merged into one Chrome trace that
Perfetto and chrome://tracing open (chrome.py), and read back by the
analysis (analysis.py, gantt.py). This package imports nothing of paratrain
above config, so the communication layer can call it.
"""
from .recorder import label, span, start, stop


def start_from_env(role, index, offset_s=0.0, uncertainty_s=None, **header):
    """Start recording where PARATRAIN_TRACE says, once per process, with every torch
    optimizer's steps. ``offset_s``: this clock's offset to rank 0's (pt.init measures it,
    clock.py); a process that joins no group (a parameter-server worker, a server) takes
    its clock as rank 0's, which holds on one host."""
    from .. import config
    from . import recorder
    directory = config.get("PARATRAIN_TRACE")
    if directory and not recorder.ON:
        import torch

        from . import optimizer
        optimizer.install()
        if uncertainty_s is None:
            header.setdefault("clock_note", "taken as rank 0's (no group to measure it against)")
        recorder.start(directory, role, index, offset_s, uncertainty_s, count_cpu=torch.get_num_threads() == 1,
                       **header)


def enabled():
    """Whether this process is recording."""
    from . import recorder
    return recorder.ON


__all__ = ["label", "span", "start", "stop", "start_from_env", "enabled"]
