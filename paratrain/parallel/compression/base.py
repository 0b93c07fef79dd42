"""What a gradient compressor is to DataParallel (comm_hooks.py's contract, widened).

DataParallel calls ``hook(group, index, flat)`` for each bucket, in the same
bucket order on every rank; the hook leaves the (approximate) average of the
ranks' buckets in ``flat``. A compressor may send any payload of any size
with any collective on the way (indices and values, signs and a scale,
low-rank factors) and keep its own state per bucket (residuals, momentum,
warm starts); ``wire_bytes(flat)`` says what one rank sent for that bucket,
for the run's summary. ``sent[index]``: what this rank contributed last time
(for checking error feedback). A compressor with ``wants_shapes = True`` is
told, in ``prepare(group, flats, shapes=)``, the shapes of the gradients
each bucket holds, in order (PowerSGD compresses matrices, not a flat run).

A compressor's state is what a resumed run needs to go on as if never
stopped: ``state_dict()`` gives this rank's, flat (``"residual/0"``,
``"q/0/3"``), and ``load_state_dict`` takes it back; ``STATE`` names the
per-bucket dicts it is made of, ``PER_RANK`` those that differ between ranks
(residuals, momentum), which checkpoint.py averages when the world size
changes. The rest (warm starts, step counts) is the same on every rank.
"""
import math


class Compressor:
    wants_shapes = False
    STATE = ()        # names of the per-bucket dicts a checkpoint carries
    PER_RANK = ()     # which of them differ between ranks

    def __init__(self):
        self.sent = {}
        self.layout, self._index = [], {}

    def prepare(self, group, flats, shapes=None):
        """Note each bucket's gradients as (offset, shape) runs in ``self.layout[index]``
        (one run of the whole bucket without shapes), and which bucket each flat is."""
        self.layout, self._index = [], {}
        for index, flat in enumerate(flats):
            runs, at = [], 0
            for shape in (shapes[index] if shapes else [tuple(flat.shape)]):
                runs.append((at, tuple(shape)))
                at += math.prod(shape)
            self.layout.append(runs)
            self._index[id(flat)] = index

    def wire_bytes(self, flat):
        raise NotImplementedError

    def state_dict(self):
        """This rank's state, one flat dict: ``"<dict name>/<bucket index>[/<part>]"`` -> tensor or int."""
        out = {}
        for name in self.STATE:
            for key, value in getattr(self, name).items():
                parts = key if isinstance(key, tuple) else (key,)
                out["/".join([name, *map(str, parts)])] = value.clone() if hasattr(value, "clone") else value
        return out

    def load_state_dict(self, state):
        """Take back what ``state_dict`` gave (this rank's, or checkpoint.py's average over ranks)."""
        for name in self.STATE:
            getattr(self, name).clear()
        for flat_key, value in state.items():
            name, *parts = flat_key.split("/")
            if name not in self.STATE:
                raise ValueError(f"a {type(self).__name__} compressor holds no {name!r} state (saved by another "
                                 f"compressor?); it holds {', '.join(self.STATE)}")
            key = int(parts[0]) if len(parts) == 1 else tuple(int(part) for part in parts)
            if name in self.PER_RANK and isinstance(key, int) and key < len(self.layout):
                size = sum(math.prod(shape) for _, shape in self.layout[key])
                if value.numel() != size:
                    raise ValueError(f"the saved {name} of gradient bucket {key} has {value.numel()} entries, "
                                     f"this run's bucket {size}: resume with the model and --bucket-mb it was "
                                     "saved with")
            getattr(self, name)[key] = value.clone() if hasattr(value, "clone") else value

    def __call__(self, group, index, flat):
        raise NotImplementedError
