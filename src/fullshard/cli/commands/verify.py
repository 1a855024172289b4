"""``fullshard verify CHECKPOINT``: check every file of a checkpoint against what was recorded when it was written.

Exit code 0 and one summary line when the checkpoint is whole; exit code 2 and one line naming the first bad
file and what is wrong otherwise (see ``fullshard.checkpoint.verify``). A folder that is not a checkpoint but
holds some (a project folder, its ``checkpoints/``, a folder of saves) is answered with the list of those, and
exit code 2: see :func:`~fullshard.cli.commands.merge.checkpoints_under`.
"""

from __future__ import annotations

import click

from fullshard.cli.commands.merge import checkpoint_errors, not_a_checkpoint_but_holds

__all__ = ["verify_command"]


@click.command(
    "verify",
    short_help="Check a checkpoint's files (presence, sizes, checksums, all ranks).",
    epilog="Example: fullshard verify runs/train_gpt/checkpoints/checkpoint_3",
)
@click.argument("checkpoint", type=click.Path())
def verify_command(checkpoint: str) -> None:
    """Check CHECKPOINT: a folder that save_state wrote (such as runs/x/checkpoints/checkpoint_3) or one
    sharded folder in it (such as checkpoint_3/pytorch_model_fsdp_0). It checks what a load checks: every file
    present with the size and CRC-32 recorded at save (each stored item's, in sharded folders), every rank's
    files present, the sharded folders' metadata whole, every value readable; files with other hard links are
    named.

    Given a folder that holds checkpoints (a project folder or its checkpoints/), it lists them. Exit code: 0
    when the checkpoint is whole, 2 otherwise (one line naming the first bad file, or the folders to pass).
    """
    from fullshard.checkpoint import verify_checkpoint

    with checkpoint_errors():
        holds = not_a_checkpoint_but_holds(checkpoint, "verify")
        if holds is not None:
            raise holds
        report = verify_checkpoint(checkpoint)
    if report.note:
        click.echo(f"{report.note}.")
    if report.linked:
        shown = ", ".join(report.linked[:5]) + (f" and {len(report.linked) - 5} more" if len(report.linked) > 5 else "")
        click.echo(
            f"note: {len(report.linked)} file(s) have other hard links ({shown}): a write through another name "
            "changes this checkpoint too. Copy the checkpoint (cp without -l) to give it files of its own."
        )
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
