"""Algorithms built on the engine's public API, kept outside it as torch keeps them outside FSDP.

``comm_hooks`` (DDP-style communication hooks for ``register_comm_hook``) and ``grad_scaler``
(``ShardedGradScaler``) import the engine; the engine never imports this package.
"""
