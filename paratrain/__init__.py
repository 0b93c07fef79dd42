"""paratrain: distributed training for PyTorch.

    import paratrain as pt
    pt.init()
    g = pt.world()
    g.all_reduce(t, op="sum")

The API is imported on first use, so that ``paratrain run`` starts its
workers without first paying for importing torch itself.
"""
import importlib

__version__ = "0.1.0"

_API = {name: "paratrain.comm" for name in (
    "init", "world", "new_group", "destroy", "is_initialized", "ProcessGroup", "Work",
    "CommError", "CommTimeout", "PeerError", "MismatchError", "FrameError")}
_API.update({name: "paratrain.parallel" for name in (
    "DataParallel", "DataParallelNaive", "DistributedSampler")})
_API["Pipeline"] = "paratrain.parallel.pipeline"
_API["mesh"] = "paratrain.parallel.mesh"
_API["ZeRO"] = "paratrain.parallel.zero"
_NAMESPACES = {"ps": "paratrain.ps", "pipeline": "paratrain.parallel.pipeline",   # pt.ps.connect(), pt.pipeline.split()
               "tensor": "paratrain.parallel.tensor",                              # pt.tensor.ColumnParallelLinear
               "functional": "paratrain.parallel.tensor.functional",               # pt.functional.all_reduce
               "trace": "paratrain.trace",                                         # pt.trace.span("name")
               "elastic": "paratrain.elastic"}                                     # pt.elastic.ElasticSampler
__all__ = sorted(_API)


def __getattr__(name):
    if name in _NAMESPACES:  # APIs with their own namespace: pt.ps.connect(), pt.pipeline.split()
        value = importlib.import_module(_NAMESPACES[name])
        globals()[name] = value
        return value
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'paratrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
