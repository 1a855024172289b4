"""Algorithms built on the engine's public API, kept outside it as torch keeps them outside FSDP.

``comm_hooks`` (DDP-style communication hooks for ``register_comm_hook``), ``grad_scaler``
(``ShardedGradScaler``), ``full_load`` (a full state dict on rank 0 into the shards) and ``optim_init``
(an optimizer's state created before its first step) import the engine or only torch; the engine never
imports this package.
"""
