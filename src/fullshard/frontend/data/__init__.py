"""Data loading: the Accelerator's loaders, Accelerate's loader classes and its free ``prepare_data_loader``.

- ``sharded_loader.py``: ``ShardedDataLoader`` and its batch sampler, what ``Accelerator.prepare`` makes of a
  ``DataLoader`` ([Note: batch dealing], [Note: loader position]); ``skip_first_batches``, the RNG synchronisation.
- ``sample_order.py``: the order an epoch visits the samples in, the same as Accelerate's for a seed.
- ``dataloader_config.py``: ``DataLoaderConfiguration``, every field honoured or refused by name.
- ``gradient_state.py``: ``GradientState``, the step state the loaders, optimizers and schedulers share.
- ``loader_parts.py``: Accelerate's own loader classes (``DataLoaderShard``, ``BatchSamplerShard``, ...).
- ``loader_prepare.py``: Accelerate's free ``prepare_data_loader``, a loader prepared without an ``Accelerator``.
"""
