"""The parameter server: sharded servers, push/pull, BSP/ASP/SSP.

    ps = pt.ps.connect()                 # in a worker started by `paratrain run --servers S -n N`
    ps.register(model, optimizer="adam", lr=1e-3, consistency="ssp", staleness=3)
    ps.pull(model); loss.backward(); ps.push(model); ps.clock()
    emb = pt.ps.Embedding(10_000_000, 64)   # rows live on the servers; only touched rows move

wire.py (frames), sharding.py (placement), optimizers.py (server-side state),
consistency.py (the clock rule), server.py (one server process), client.py
(a worker's connection), shard.py (a dense shard and its BSP round), rows.py +
embedding.py (sparse embedding tables), shared.py (the same-host shared-memory
path), server_state.py (server checkpoints).
"""
from .client import Client, PSError, connect
from .embedding import Embedding

__all__ = ["connect", "Client", "PSError", "Embedding"]
