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
"""
import math


class Compressor:
    wants_shapes = False

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

    def __call__(self, group, index, flat):
        raise NotImplementedError
