"""The parameter server: sharded servers, push/pull, BSP/ASP/SSP.

    ps = pt.ps.connect()                 # in a worker started by `paratrain run --servers S -n N`
    ps.register(model, optimizer="adam", lr=1e-3, consistency="ssp", staleness=3)
    ps.pull(model); loss.backward(); ps.push(model); ps.clock()

wire.py (frames), sharding.py (placement), optimizers.py (server-side state),
consistency.py (the clock rule), server.py (one server process), client.py
(a worker's connection).
"""
from .client import Client, PSError, connect

__all__ = ["connect", "Client", "PSError"]
