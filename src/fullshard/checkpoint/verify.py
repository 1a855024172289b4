"""Check a checkpoint before trusting it: ``fullshard verify``, ``load_state(verify=True)``, ``merge-weights --verify``.

Two levels:

- :func:`check_parts` (cheap, run by every ``load_state``): with a manifest, every file it lists is present
  with its recorded size, no part that ``load_state`` reads is missing from it, every saving rank's random
  states file is listed, and every sharded subfolder passes :func:`~fullshard.checkpoint.folder.check_part`
  (not a link, its marker's CRC-32 and ``save_id`` those the manifest records: a folder copied in from another
  save is named). Without one (Accelerate, older fullshard), the subfolders' markers, if any, must agree on
  their ``save_id``, and a checkpoint whose markers show that fullshard wrote it is refused (its manifest was
  removed). See [Note: one rule for every reader] in ``folder.py``.
- :func:`verify_checkpoint` (reads every byte): what a load checks, in full, and what a load would read
  (see [Note: verify is a load]).

Both raise :class:`CheckpointDamagedError` naming the first bad file (in sorted order) and what is wrong,
or :class:`NotACheckpointError` for a folder that holds no checkpoint at all.

[Note: verify is a load]
``verify`` answers "will a load of this work, and load what was saved?", so it refuses exactly what some load
would refuse, for the same reason, and nothing a load takes: the cheap checks above (the ones ``load_state``
runs, or for a sharded folder given alone those ``load_sharded`` and ``merge`` run: ``reader.
resolve_checkpoint_dir``); each sharded folder's ``.metadata`` (against its marker's CRC-32) and data files;
every stored value of every sharded folder read as a load reads it, item CRCs included
(``reader.read_every_item``); every plain file a load reads whole checked against the manifest's CRC-32 and
read by the same safe unpickler. Two checks go beyond a load, since a load cannot make them: a data file whose
marker records a whole-file CRC-32 but no item checksums (no ISA-L when it was saved) is checked whole, and
files with other hard links (``st_nlink > 1``: a write through another name changes this checkpoint) are
named in the report (:attr:`VerifyReport.linked`), not refused.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from fullshard.checkpoint.boundary import entry_path
from fullshard.checkpoint.checksum import file_checksum
from fullshard.checkpoint.errors import CheckpointDamagedError, NotACheckpointError
from fullshard.checkpoint.folder import (
    FolderState,
    check_enclosing,
    check_part,
    check_sizes,
    checkpoint_state,
    folder_to_load,
    missing_message,
    staging_error,
)
from fullshard.checkpoint.manifest import Manifest, read_folder_marker, read_manifest
from fullshard.checkpoint.names import (
    CHECKPOINT_MANIFEST,
    DCP_METADATA_FILE,
    FOLDER_MARKER,
    RNG_STATE_NAME,
    is_load_state_part,
    rng_state_file_name,
)
from fullshard.checkpoint.reader import check_data_files, read_every_item, read_metadata
from fullshard.checkpoint.safe_load import load_rng_file, load_small_file

__all__ = ["CheckpointDamagedError", "NotACheckpointError", "VerifyReport", "check_parts", "verify_checkpoint"]


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify_checkpoint` checked."""

    folder: Path
    files: int
    bytes: int
    checksummed: bool  # False for checkpoints written without checksums (Accelerate, older fullshard)
    save_id: str | None
    note: str = ""  # what load_state would do differently (it falls back to ``<folder>.previous``)
    linked: tuple[str, ...] = ()  # files with other hard links (st_nlink > 1), relative to ``folder``


def _dcp_folders(root: Path) -> list[Path]:
    subs = [p for p in root.iterdir() if p.is_dir() and ((p / DCP_METADATA_FILE).exists() or any(p.glob("*.distcp")))]
    return sorted(entry_path(root, p.name) for p in subs)  # a linked subfolder is refused, not read


def _describe(root: Path) -> tuple[Manifest | None, bool]:
    """The manifest (or a single sharded folder's marker) and whether ``root`` is itself a sharded folder."""
    manifest = read_manifest(root)
    if manifest is not None:
        return manifest, False
    single = (root / DCP_METADATA_FILE).exists() or any(root.glob("*.distcp"))
    return (read_folder_marker(root) if single else None), single


def _check_listed(root: Path, manifest: Manifest) -> None:
    check_sizes(root, manifest.files, manifest.path.name)


def _check_unlisted(root: Path, manifest: Manifest) -> None:
    listed = set(manifest.files)
    for entry in sorted(root.iterdir()):
        if not is_load_state_part(entry.name):
            continue
        names = [entry.name] if entry.is_file() else [
            f"{entry.name}/{p.name}" for p in sorted(entry.iterdir()) if p.is_file() and p.name != FOLDER_MARKER
        ]  # fmt: skip
        for name in names:
            if name not in listed:
                raise CheckpointDamagedError(
                    f"{root / name} is not part of save {manifest.save_id} ({manifest.path} does not list it): "
                    "it comes from another save. Remove it, or load another checkpoint."
                )


def _check_save_ids(root: Path, manifest: Manifest | None) -> None:
    ids = {}
    for sub in _dcp_folders(root):
        marker = read_folder_marker(sub)
        if marker is not None and marker.save_id is not None:
            ids[sub.name] = marker.save_id
    expected = manifest.save_id if manifest is not None else None
    if expected is not None:
        foreign = {name: sid for name, sid in ids.items() if sid != expected}
        if foreign:
            name, sid = sorted(foreign.items())[0]
            raise CheckpointDamagedError(
                f"{root}: its parts come from different saves: '{name}' is from save {sid}, the checkpoint "
                f"({CHECKPOINT_MANIFEST}) from save {expected}. Load another checkpoint, or re-save."
            )
    elif len(set(ids.values())) > 1:
        listed = ", ".join(f"'{name}' from save {sid}" for name, sid in sorted(ids.items()))
        raise CheckpointDamagedError(
            f"{root}: its parts come from different saves ({listed}). Load another checkpoint, or re-save."
        )


def check_parts(folder: str | os.PathLike[str]) -> Manifest | None:
    """The cheap checks every ``load_state`` runs (see the module docstring); returns the manifest if any."""
    root = Path(folder)
    manifest = read_manifest(root)
    _check_save_ids(root, manifest)  # first: a part copied from another save is named as such
    if manifest is not None:
        _check_listed(root, manifest)
        _check_unlisted(root, manifest)
        _check_rng_files(root, manifest)
    for sub in _dcp_folders(root):
        if is_load_state_part(sub.name):
            check_part(root, sub.name, manifest)
    return manifest


def _check_rng_files(root: Path, manifest: Manifest) -> None:
    for rank in range(manifest.world_size):
        name = rng_state_file_name(rank)
        if name not in manifest.files:
            raise CheckpointDamagedError(
                f"{root / name} is missing (the save had {manifest.world_size} ranks; {manifest.path} lacks this "
                "rank's file): the checkpoint is incomplete. Load another checkpoint."
            )


def check_file(path: Path, manifest: Manifest | None) -> None:
    """Read ``path`` whole and raise :class:`CheckpointDamagedError` if its CRC-32 is not the one ``manifest``
    records for it (nothing to check without a manifest, or for a file it lists without a checksum)."""
    record = manifest.files.get(path.relative_to(manifest.path.parent).as_posix()) if manifest is not None else None
    if record is None or record.crc32 is None:
        return
    actual = file_checksum(path)
    if actual.crc32 != record.crc32:
        raise CheckpointDamagedError(
            f"{path} is corrupt: its CRC-32 is {actual.crc32:08x}, but it was written with "
            f"{record.crc32:08x} ({manifest.path.name}). Load another checkpoint, or re-save."
        )


def _check_dcp(folder: Path, share: tuple[int, int]) -> None:
    """A sharded folder as a load reads it, every value (see [Note: verify is a load])."""
    if not (folder / DCP_METADATA_FILE).is_file():
        raise CheckpointDamagedError(missing_message(folder / DCP_METADATA_FILE))
    try:
        metadata = read_metadata(folder)
        check_data_files(folder, metadata)
    except (FileNotFoundError, RuntimeError) as exc:
        raise CheckpointDamagedError(str(exc)) from None
    read_every_item(folder, metadata, share=share)
    marker = read_folder_marker(folder)
    if marker is None:
        return
    rank, world = share
    unchecked = [name for name, record in sorted(marker.files.items()) if name.endswith(".distcp") and not record.items]
    for i, name in enumerate(unchecked):  # no item checksums: the whole file's, which a load cannot check
        if i % world == rank:
            check_file(folder / name, marker)


def _read_plain_files(root: Path, manifest: Manifest | None, share: tuple[int, int]) -> None:
    """Every plain file a load reads whole: its CRC-32 against the manifest's (if any; ``check_parts`` refused
    the files it does not list), then read by the same safe unpickler."""
    rank, world = share
    plain = [p.name for p in sorted(root.iterdir()) if is_load_state_part(p.name) and not p.is_dir()]
    for i, name in enumerate(plain):
        if i % world != rank:
            continue
        path = entry_path(root, name)
        check_file(path, manifest)
        try:
            (load_rng_file if name.startswith(RNG_STATE_NAME) else load_small_file)(path)
        except (RuntimeError, ValueError, OSError) as exc:
            raise CheckpointDamagedError(str(exc)) from None


def _hard_links(root: Path) -> tuple[str, ...]:
    found = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = Path(dirpath, name)
            if not path.is_symlink() and path.stat().st_nlink > 1:
                found.append(path.relative_to(root).as_posix())
    return tuple(sorted(found))


def _not_a_checkpoint(root: Path) -> NotACheckpointError:
    if not root.exists():
        return NotACheckpointError(f"'{root}' does not exist; pass the folder save_state or save_sharded wrote.")
    if not root.is_dir():
        return NotACheckpointError(f"'{root}' is a file, not a checkpoint folder; pass the folder save_state wrote.")
    return NotACheckpointError(
        f"'{root}' is not a checkpoint: it holds no {CHECKPOINT_MANIFEST}, no {DCP_METADATA_FILE} and no "
        f"{rng_state_file_name(0)}. Pass the folder save_state wrote (or one of its "
        "pytorch_model_fsdp_<i>/optimizer_<i>)."
    )


def verify_checkpoint(folder: str | os.PathLike[str], *, share: tuple[int, int] | None = None) -> VerifyReport:
    """Check every file of a checkpoint; raise :class:`CheckpointDamagedError` naming the first bad one.

    ``folder`` is a ``save_state`` folder or one sharded (DCP) folder. ``share=(rank, world)`` computes the
    checksums of only every ``world``-th file starting at ``rank`` (the other checks run in full), so that the
    ranks of a ``load_state(verify=True)`` split the reading between them.
    """
    root = Path(folder)
    state = checkpoint_state(root)
    if state is FolderState.PREVIOUS_ONLY:  # say what load_state would do: load the previous checkpoint
        loaded = folder_to_load(root)
        note = (
            f"'{root}' does not exist (a save was killed while replacing it); load_state('{root}') loads the "
            f"whole previous checkpoint from '{loaded}' with a warning, and the next save_state puts it back"
        )
        return dataclasses.replace(verify_checkpoint(loaded, share=share), note=note)  # fmt: skip
    if not root.is_dir():
        raise _not_a_checkpoint(root)
    if state is FolderState.STAGING:
        raise staging_error(root)
    manifest, single = _describe(root)
    if manifest is None and not single and not (root / rng_state_file_name(0)).is_file() and not _dcp_folders(root):
        raise _not_a_checkpoint(root)
    share = share or (0, 1)
    if single:
        check_enclosing(root)  # a part of a save_state checkpoint: what its loads check of it
        _check_dcp(root, share)
    else:
        check_parts(root)
        _read_plain_files(root, manifest, share)
        for sub in _dcp_folders(root):
            _check_dcp(sub, share)
    files = manifest.files if manifest is not None else {}
    checksummed = manifest is not None and all(r.crc32 is not None for r in files.values())
    return VerifyReport(root, len(files), sum(r.size for r in files.values()), checksummed,
                        manifest.save_id if manifest else None, linked=_hard_links(root))  # fmt: skip
