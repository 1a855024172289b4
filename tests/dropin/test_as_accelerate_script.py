"""An Accelerate example-style script, its imports left as ``from accelerate import ...``, run by
``fullshard launch --as_accelerate``: the same run as the script with its imports changed to fullshard.

Set up: ``scripts/gradient_accumulation.py`` as Accelerate users write it (``accelerate`` imports, nothing of
fullshard), Accelerate's FSDP config file.
Run: it under ``fullshard launch --config_file fsdp.yaml --as_accelerate``; the fullshard-import version under
the same launch without the flag.
Check: every rank's samples, per-epoch losses and optimizer steps are the same, to the bit.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.dropin.test_example_scripts import CONFIGS, ROOT, SCRIPTS, _env, finish, records, start_fullshard


def test_unedited_accelerate_script_runs_as_its_fullshard_twin(tmp_path: Path) -> None:
    # - Set up: the script with Accelerate's imports, beside its data module
    folder = tmp_path / "accelerate_scripts"
    folder.mkdir()
    shutil.copy(SCRIPTS / "toy_data.py", folder)
    text = (SCRIPTS / "gradient_accumulation.py").read_text()
    text = text.replace("\nfrom fullshard import ", "\nfrom accelerate import ")
    text = text.replace("\nfrom fullshard.utils import ", "\nfrom accelerate.utils import ")
    assert "fullshard" not in text.split('"""', 2)[2]
    (folder / "gradient_accumulation.py").write_text(text)
    config_file = tmp_path / "fsdp.yaml"
    config_file.write_text(CONFIGS["fsdp"])
    # - Run: both side by side
    script = folder / "gradient_accumulation.py"
    command = [sys.executable, "-m", "fullshard.cli.main", "launch", "--config_file", str(config_file),
               "--as_accelerate", str(script), "--output", str(tmp_path / "served")]  # fmt: skip
    env = _env(PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}", FULLSHARD_HOME=str(tmp_path / "home"))
    served = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ours = start_fullshard(tmp_path, "fsdp", "gradient_accumulation.py", "--output", str(tmp_path / "ours"))
    finish(served)
    finish(ours)
    # - Check
    assert records(tmp_path / "served") == records(tmp_path / "ours")
    assert records(tmp_path / "served")[0]["optimizer_steps"] > 0
