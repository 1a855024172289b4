"""``fullshard merge-weights CHECKPOINT_DIR OUTPUT_PATH``: one weights file from a sharded checkpoint."""

from __future__ import annotations

import click

__all__ = ["merge_command"]


@click.command("merge-weights", short_help="Merge a sharded FSDP checkpoint into one weights file.")
@click.argument("checkpoint_dir", type=click.Path(exists=True, file_okay=False))
@click.argument("output_path", type=click.Path())
@click.option(
    "--unsafe_serialization",
    "--unsafe-serialization",
    "unsafe_serialization",
    is_flag=True,
    help="Write pytorch_model.bin (pickle) instead of model.safetensors.",
)
@click.option(
    "--remove_checkpoint_dir",
    "--remove-checkpoint-dir",
    "remove_checkpoint_dir",
    is_flag=True,
    help="Delete CHECKPOINT_DIR after merging.",
)
def merge_command(
    checkpoint_dir: str, output_path: str, unsafe_serialization: bool, remove_checkpoint_dir: bool
) -> None:
    """Merge the shards in CHECKPOINT_DIR (a SHARDED_STATE_DICT model or optimizer folder) into OUTPUT_PATH."""
    try:  # imported here: it pulls in the checkpoint code, which the other commands do not need
        from fullshard.checkpoint.merge import merge_fsdp_weights
    except ImportError as exc:
        raise click.ClickException(f"merge-weights is unavailable: {exc}. Reinstall fullshard.") from None

    try:
        merge_fsdp_weights(
            checkpoint_dir,
            output_path,
            safe_serialization=not unsafe_serialization,
            remove_checkpoint_dir=remove_checkpoint_dir,
        )
    except (ValueError, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from None
