"""Algorithms built on the engine's public API, kept outside it as torch keeps them outside FSDP.

``comm_hooks`` (DDP-style communication hooks for ``register_comm_hook``), ``grad_scaler``
(``ShardedGradScaler``), ``full_load`` (a full state dict on rank 0 into the shards), ``optim_init``
(an optimizer's state created before its first step), ``checkpointing`` (activation checkpointing, as
torch keeps it in ``torch.distributed.algorithms``) and ``plan`` (a model's sharding resolved once, then applied
through the two entry points) import the engine or only torch; the engine never imports this package.
"""
