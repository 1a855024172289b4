"""``DataLoaderConfiguration``: how ``Accelerator.prepare`` deals a ``DataLoader`` to the ranks (Accelerate's fields).

Every field is honoured or refused by name when the configuration is built (on every rank, before any data
is touched):

- ``split_batches``: each global batch is the original loader's batch, cut into ``num_processes`` pieces
  (the batch size must divide by the number of processes); otherwise each rank gets whole batches.
- ``dispatch_batches``: ``None`` or ``False``: every rank reads its own share of the dataset by index. ``True``:
  rank 0 iterates the loader and sends each rank its batch of every round (its slice of each batch with
  ``split_batches``), as Accelerate's ``DataLoaderDispatcher`` (for data only rank 0 can read); refused in
  world-size-invariant mode and with tensor parallel groups.
- ``even_batches``: complete the last global batch with samples from the start of the epoch.
- ``use_seedable_sampler`` / ``data_seed``: a shuffling loader deals the permutation of ``data_seed + epoch``
  (``data_seed`` defaults to ``torch.initial_seed()``); otherwise one generator continues from epoch to epoch.
- ``non_blocking``: batches are moved to the device with ``non_blocking=True``.
- ``use_stateful_dataloader``: ``load_state`` also restores the position within the epoch (without it, only
  the shuffling state and the epoch; skip the batches already seen with ``Accelerator.skip_first_batches``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["DataLoaderConfiguration", "resolve_dataloader_config"]


@dataclass
class DataLoaderConfiguration:
    """Accelerate's dataloader settings; see the module docstring for what each does here."""

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "data_seed":
                if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                    raise TypeError(f"DataLoaderConfiguration(data_seed={value!r}): expected an int or None.")
            elif f.name == "dispatch_batches":
                if value is not None and not isinstance(value, bool):
                    raise TypeError(f"DataLoaderConfiguration(dispatch_batches={value!r}): expected a bool or None.")
            elif not isinstance(value, bool):
                raise TypeError(f"DataLoaderConfiguration({f.name}={value!r}): expected True or False.")


def resolve_dataloader_config(
    dataloader_config: object, split_batches: bool | None, even_batches: bool | None
) -> DataLoaderConfiguration:
    """The configuration ``Accelerator(...)`` uses: ``dataloader_config``, or one built from the older keywords.

    ``split_batches`` / ``even_batches`` given to ``Accelerator`` directly (``None``: not given) fill a default
    configuration; given together with ``dataloader_config`` they must agree with it.
    """
    if dataloader_config is None:
        return DataLoaderConfiguration(
            split_batches=bool(split_batches) if split_batches is not None else False,
            even_batches=even_batches if even_batches is not None else True,
        )
    if not isinstance(dataloader_config, DataLoaderConfiguration):
        raise TypeError(
            f"Accelerator(dataloader_config={type(dataloader_config).__name__}): expected a DataLoaderConfiguration "
            "(from fullshard import DataLoaderConfiguration), or None for the defaults."
        )
    for name, value in (("split_batches", split_batches), ("even_batches", even_batches)):
        if value is not None and value != getattr(dataloader_config, name):
            raise ValueError(
                f"Accelerator({name}={value!r}, dataloader_config=DataLoaderConfiguration({name}="
                f"{getattr(dataloader_config, name)!r})): the two disagree. Set {name} in the DataLoaderConfiguration "
                "only."
            )
    return dataloader_config
