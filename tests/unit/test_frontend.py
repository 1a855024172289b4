"""Pure pieces of the front end (no process group): argument checks, batch dealing, step counting, data ops.

Every message a user can meet here is pinned with ``re.escape``.
"""

from __future__ import annotations

import re
from collections import namedtuple

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, SequentialSampler

from fullshard.cli.memory_estimate import estimate_memory, find_unit_classes, unit_parameters
from fullshard.engine.api import ShardingStrategy
from fullshard.frontend import ops
from fullshard.frontend.accelerator import Accelerator
from fullshard.frontend.data.dataloader_config import DataLoaderConfiguration
from fullshard.frontend.data.sharded_loader import GradientState, ShardBatchSampler, prepare_data_loader
from fullshard.frontend.enums import DistributedType, PrecisionType
from fullshard.frontend.plugin import FullyShardedDataParallelPlugin
from fullshard.frontend.prepare import fsdp2_switch_optimizer_parameters, prepare_model
from fullshard.frontend.saving.state_io import TrainingObjects, save_state
from fullshard.frontend.training import advance_step, truncate_for_metrics
from fullshard.testing.models import Block, TinyGPT
from fullshard.utils import compute_module_sizes, find_executable_batch_size

# --- Accelerator arguments (checked before any process group exists) -------------------------------


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"gradient_accumulation_steps": 0}, ValueError,
         "Accelerator(gradient_accumulation_steps=0): expected an int >= 1 (1 means no accumulation)."),
        ({"fsdp_plugin": "fsdp"}, TypeError,
         "Accelerator(fsdp_plugin=str): expected a FullyShardedDataParallelPlugin"),
        ({"split_batches": True, "dataloader_config": DataLoaderConfiguration()}, ValueError,
         "Accelerator(split_batches=True, dataloader_config=DataLoaderConfiguration(split_batches=False)): "
         "the two disagree."),
        ({"dataloader_config": {"split_batches": True}}, TypeError,
         "Accelerator(dataloader_config=dict): expected a DataLoaderConfiguration"),
        ({"rng_types": ["xla"]}, ValueError, "Accelerator(rng_types=['xla']): expected a list of 'generator', "),
        ({"mixed_precision": "int8"}, ValueError,
         "Accelerator(mixed_precision)='int8': not a precision. Use one of \"no\", \"fp16\", \"bf16\"."),
        ({"deepspeed_plugin": object()}, TypeError,
         "Accelerator(deepspeed_plugin=...): fullshard is FSDP only (no DeepSpeed"),
        ({"device_map": None}, TypeError, "Accelerator(device_map=...): not an argument fullshard knows."),
    ],
)  # fmt: skip
def test_accelerator_argument_errors(kwargs: dict[str, object], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        Accelerator(**kwargs)  # type: ignore[arg-type]


def test_enums() -> None:
    assert PrecisionType.parse(None) is PrecisionType.NO
    assert PrecisionType.parse("BF16") is PrecisionType.BF16
    assert DistributedType.FSDP == "FSDP"


# --- batch dealing ---------------------------------------------------------------------------------


def deal(n: int, batch: int, world: int, *, drop_last: bool = False, even: bool = True) -> list[list[list[int]]]:
    samplers = [
        ShardBatchSampler(SequentialSampler(range(n)), batch, world, r, drop_last=drop_last, even_batches=even)
        for r in range(world)
    ]
    dealt = [list(s) for s in samplers]
    assert [len(s) for s in samplers] == [len(d) for d in dealt], "len() must match what iteration yields"
    return dealt


def test_dealing_is_round_robin_and_even() -> None:
    assert deal(11, 2, 2) == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [10, 0]]]
    assert deal(8, 2, 2) == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert deal(3, 4, 2) == [[[0, 1, 2, 0]], [[1, 2, 0, 1]]]  # fewer samples than one step: cycle


def test_dealing_drop_last_and_uneven() -> None:
    assert deal(11, 2, 2, drop_last=True) == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert deal(10, 4, 2, even=False) == [[[0, 1, 2, 3], [8, 9]], [[4, 5, 6, 7]]]


def test_prepare_data_loader_refuses_what_it_cannot_deal() -> None:
    class Stream(IterableDataset):
        def __iter__(self):  # type: ignore[no-untyped-def]
            yield from range(3)

    kwargs = {"num_processes": 2, "process_index": 0, "device": None, "gradient_state": GradientState()}
    with pytest.raises(ValueError, match=re.escape("got a DataLoader over an IterableDataset (Stream)")):
        prepare_data_loader(DataLoader(Stream(), batch_size=2), **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=re.escape("got a DataLoader with batch_size=None")):
        prepare_data_loader(DataLoader(range(4), batch_size=None), **kwargs)  # type: ignore[arg-type]


# --- steps and metrics -----------------------------------------------------------------------------


def test_advance_step_syncs_every_n_and_at_the_loader_end() -> None:
    state = GradientState(num_steps=3)
    syncs = []
    for i in range(5):
        state.end_of_dataloader = i == 4
        advance_step(state)
        syncs.append(state.sync_gradients)
    assert syncs == [False, False, True, False, True]


def test_truncate_for_metrics_only_on_the_last_batch() -> None:
    state = GradientState(end_of_dataloader=False, remainder=3)
    data = {"x": torch.arange(4)}
    assert truncate_for_metrics(data, state, objects=False)["x"].tolist() == [0, 1, 2, 3]
    state.end_of_dataloader = True
    assert truncate_for_metrics(data, state, objects=False)["x"].tolist() == [0, 1, 2]
    assert truncate_for_metrics(["a", "b", "c", "a"], state, objects=True) == ["a", "b", "c"]


# --- optimizer switching, plugin use, checkpoint objects ------------------------------------------


def test_switch_optimizer_parameters_keeps_groups_and_raises_key_error() -> None:
    a, b, c = (nn.Parameter(torch.zeros(2)) for _ in range(3))
    new_a, new_b = nn.Parameter(torch.ones(1)), nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.2}], lr=1.0)
    fsdp2_switch_optimizer_parameters(optimizer, {a: new_a, b: new_b})
    assert [g["params"][0] for g in optimizer.param_groups] == [new_a, new_b]
    assert [g["lr"] for g in optimizer.param_groups] == [0.1, 0.2]
    broken = torch.optim.SGD([{"params": [a, c]}], lr=1.0)
    message = "fsdp2_switch_optimizer_parameters: parameter 1 of param group 0 (a Parameter of dtype torch.float32) "
    with pytest.raises(KeyError, match=re.escape(message + "has no sharded replacement in mapping")):
        fsdp2_switch_optimizer_parameters(broken, {a: new_a})


def test_activation_checkpointing_needs_a_wrap_policy() -> None:
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, activation_checkpointing=True)
    message = "FullyShardedDataParallelPlugin(activation_checkpointing=True, auto_wrap_policy=None)"
    with pytest.raises(ValueError, match=re.escape(message)):
        prepare_model(TinyGPT(), plugin, torch.device("cpu"))


def test_save_state_checks_objects_before_writing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    message = f"Accelerator.save_state(output_dir='{tmp_path}'): registered object 0 (int) has no state_dict()"
    with pytest.raises(TypeError, match=re.escape(message)):
        save_state(tmp_path, TrainingObjects(custom=[3]), plugin)
    message = "1 optimizer(s) were prepared but no model"
    with pytest.raises(ValueError, match=re.escape(message)):
        save_state(tmp_path, TrainingObjects(optimizers=[object()]), plugin)
    assert list(tmp_path.iterdir()) == []


# --- data operations without a process group ------------------------------------------------------


def test_ops_single_process() -> None:
    assert ops.gather(torch.tensor(3.0)).tolist() == [3.0]
    assert ops.gather_object(["a"]) == ["a"]
    assert ops.reduce({"x": torch.ones(2)}, "sum", scale=2.0)["x"].tolist() == [2.0, 2.0]
    pair = namedtuple("pair", "a b")
    moved = ops.send_to_device({"p": pair(torch.ones(1), 3), "skip": torch.ones(1)}, "cpu", skip_keys="skip")
    assert isinstance(moved["p"], pair) and moved["p"].b == 3
    joined = ops.concatenate([{"x": torch.zeros(1, 2)}, {"x": torch.ones(2, 2)}])
    assert joined["x"].shape == (3, 2)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: ops.reduce(torch.ones(1), "max"), ValueError,
         'reduce(reduction=\'max\'): not a reduction. Use "mean", "sum" or "none".'),
        (lambda: ops.gather({"x": "text"}), TypeError,
         "Unsupported types (<class 'str'>) passed to `_gather_one`. Only nested list/tuple/dicts of objects that "
         "are valid for `is_torch_tensor` should be passed."),  # Accelerate's words: its test_honor_type compares them
        (lambda: ops.concatenate([]), ValueError,
         "concatenate(data=list): expected a non-empty list of nested tensors."),
    ],
)  # fmt: skip
def test_ops_errors(call, error: type[Exception], message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=re.escape(message)):
        call()


def test_pad_across_processes_leaves_a_tensor_without_that_dim() -> None:
    labels = torch.arange(3)  # one class per sample: the Trainer pads labels on dim=1 all the same, as Accelerate
    assert ops.pad_across_processes(labels, dim=1) is labels


def test_set_seed_is_reproducible() -> None:
    ops.set_seed(3)
    first = torch.rand(2)
    ops.set_seed(3)
    assert torch.equal(first, torch.rand(2))


def test_find_executable_batch_size_shrinks_by_tenths_on_oom() -> None:
    tried = []

    @find_executable_batch_size(starting_batch_size=16)
    def step(batch_size: int, scale: int) -> int:
        tried.append(batch_size)
        if batch_size > 4:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2 GiB")
        return batch_size * scale

    assert step(10) == 40 and tried == [16, 14, 12, 10, 9, 8, 7, 6, 5, 4]  # int(size * 0.9), as Accelerate 1.15
    with pytest.raises(TypeError, match=re.escape("find_executable_batch_size: call step(scale) without the batch")):
        step(1, 2)


def test_compute_module_sizes() -> None:
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1, bias=False))
    sizes = compute_module_sizes(model)
    assert sizes == {"": 4 * 12, "0": 4 * 9, "0.weight": 24, "0.bias": 12, "1": 12, "1.weight": 12}
    assert compute_module_sizes(model, dtype=torch.bfloat16)[""] == 2 * 12


# --- estimate --------------------------------------------------------------------------------------


def test_estimate_errors_and_units() -> None:
    units = unit_parameters(TinyGPT(), find_unit_classes(TinyGPT(), ["Block"]))
    assert len(units) == 3 and sum(p.numel() for u in units for p in u) == 7068
    with pytest.raises(ValueError, match=re.escape("unit classes ['Nope']: not found in TinyGPT.")):
        find_unit_classes(TinyGPT(), ["Nope"])
    with pytest.raises(ValueError, match=re.escape("num_processes=0: expected at least 1 process.")):
        estimate_memory(units, 0, ShardingStrategy.FULL_SHARD)
    with pytest.raises(ValueError, match=re.escape("num_processes=3 with num_machines=2: hybrid sharding needs")):
        estimate_memory(units, 3, ShardingStrategy.HYBRID_SHARD, num_machines=2)
    full = estimate_memory(units, 4, ShardingStrategy.FULL_SHARD)
    none = estimate_memory(units, 4, ShardingStrategy.NO_SHARD)
    assert full.params < none.params / 3 and none.gathered == 0
    assert Block in find_unit_classes(TinyGPT(), ["Block"])


def test_async_save_default_comes_from_the_environment(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from fullshard import ProjectConfiguration

    monkeypatch.delenv("FULLSHARD_ASYNC_SAVE", raising=False)
    assert ProjectConfiguration().async_save is False
    monkeypatch.setenv("FULLSHARD_ASYNC_SAVE", "true")
    assert ProjectConfiguration().async_save is True
    assert ProjectConfiguration(async_save=False).async_save is False  # the field wins over the variable
    monkeypatch.setenv("FULLSHARD_ASYNC_SAVE", "sometimes")
    with pytest.raises(ValueError, match="FULLSHARD_ASYNC_SAVE"):
        ProjectConfiguration()
    with pytest.raises(ValueError, match=re.escape("ProjectConfiguration(async_save='yes'): expected True or False.")):
        ProjectConfiguration(async_save="yes")  # type: ignore[arg-type]


def _one_loader(processes: int, rank: int = 0):  # type: ignore[no-untyped-def]
    loader = DataLoader(list(range(10)), batch_size=2, shuffle=True)
    return prepare_data_loader(loader, num_processes=processes, process_index=rank, device=None,
                               gradient_state=GradientState(), use_stateful_dataloader=True)  # fmt: skip


def test_a_one_process_shuffled_epoch_resumes_mid_epoch_here_and_on_two_processes() -> None:
    # - Set up: one process, a RandomSampler drawing from the global RNG; the state after 2 batches
    torch.manual_seed(0)
    loader = _one_loader(1)
    epoch = iter(loader)
    _ = [next(epoch) for _ in range(2)]
    state, rng = loader.state_dict(), torch.get_rng_state()
    rest = [b.tolist() for b in epoch]
    following = [b.tolist() for b in loader]
    assert state["samples"] == 4 and "epoch_generator" in state
    # - Run / Check: a fresh one-process loader deals the rest of the epoch, then the epoch the global RNG draws
    torch.manual_seed(5)
    fresh = _one_loader(1)
    fresh.load_state_dict(state)
    torch.set_rng_state(rng)  # as load_state restores it
    assert [b.tolist() for b in fresh] == rest
    assert [b.tolist() for b in fresh] == following
    # - Run / Check: two processes (no collective needed here) deal the same samples, in order (then padding)
    halves = [_one_loader(2, rank) for rank in (0, 1)]
    for half in halves:
        half.load_state_dict(state)
    dealt = [i for step in zip(*[list(h) for h in halves], strict=True) for batch in step for i in batch.tolist()]
    assert dealt[:6] == [i for batch in rest for i in batch]
