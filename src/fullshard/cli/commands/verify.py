"""``fullshard verify CHECKPOINT``: check every file of a checkpoint against what was recorded when it was written.

Exit code 0 and one summary line when the checkpoint is whole; exit code 2 and one line naming the first bad
file and what is wrong otherwise (see ``fullshard.checkpoint.verify``).
"""

from __future__ import annotations

import click

from fullshard.cli.commands.merge import checkpoint_errors

__all__ = ["verify_command"]


@click.command("verify", short_help="Check a checkpoint's files (presence, sizes, checksums, all ranks).")
@click.argument("checkpoint", type=click.Path())
def verify_command(checkpoint: str) -> None:
    """Check CHECKPOINT (a save_state folder, or one sharded folder such as ckpt/pytorch_model_fsdp_0)."""
    from fullshard.checkpoint.verify import verify_checkpoint

    with checkpoint_errors():
        report = verify_checkpoint(checkpoint)
    if report.note:
        click.echo(f"{report.note}.")
    if report.checksummed:
        click.echo(
            f"{report.folder}: OK, {report.files} files ({report.bytes / 1e6:.1f} MB) present with the recorded "
            f"sizes and checksums (save {report.save_id})."
        )
    else:
        click.echo(
            f"{report.folder}: OK as far as it can be checked: its files match its DCP metadata, but it records no "
            "checksums (written by Accelerate or an older fullshard)."
        )
