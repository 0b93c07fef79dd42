"""Every torch optimizer's step as a span, with no change to the user's script.

torch.optim calls global pre- and post-step hooks around every optimizer's
``step()`` (``register_optimizer_step_pre_hook``); the pair records the step
on the compute row. Installed once, when this process starts recording.
"""
import time

from . import recorder

_started = {}
_installed = False


def install():
    global _installed
    if _installed:
        return
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    def before(optimizer, args, kwargs):
        if recorder.ON:
            _started[id(optimizer)] = (time.perf_counter(), recorder.cpu_now())

    def after(optimizer, args, kwargs):
        began = _started.pop(id(optimizer), None)
        if began is not None:
            recorder.add_compute("optimizer.step", *began, {"optimizer": type(optimizer).__name__})

    register_optimizer_step_pre_hook(before)
    register_optimizer_step_post_hook(after)
    _installed = True
