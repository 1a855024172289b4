"""What Accelerate 1.15's own CPU test files found missing or different in fullshard's ``accelerate`` (issue 31 §3):
each test pins the behaviour Accelerate has, checked against Accelerate's code and its test expectations."""

from __future__ import annotations

import os
import pickle
import re
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from fullshard import Accelerator
from fullshard.accelerate.big_modeling import cpu_offload_with_hook
from fullshard.accelerate.data_loader import (
    BatchSamplerShard,
    DataLoaderDispatcher,
    DataLoaderShard,
    IterableDatasetShard,
    SkipDataLoader,
    prepare_data_loader,
    skip_first_batches,
)
from fullshard.accelerate.state import AcceleratorState, GradientState
from fullshard.accelerate.tracking import LOGGER_TYPE_TO_CLASS, GeneralTracker, register_tracker_class
from fullshard.accelerate.utils import (
    AutocastKwargs,
    clear_environment,
    convert_dict_to_env_variables,
    find_device,
    is_fp16_available,
    pad_input_tensors,
)
from fullshard.accelerate.utils import constants as accelerate_constants
from fullshard.accelerate.utils.fsdp_utils import compile_regions_fsdp2, is_compiled_module
from fullshard.engine import FullyShardedDataParallel
from fullshard.engine.api import (
    BackwardPrefetch,
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    ShardingStrategy,
    StateDictType,
)
from fullshard.frontend.launch_helpers import debug_launcher
from fullshard.frontend.optim import AcceleratedOptimizer
from fullshard.frontend.prepare import is_sharded
from fullshard.utils import (
    FullyShardedDataParallelPlugin,
    enable_fsdp_ram_efficient_loading,
    find_executable_batch_size,
    gather,
    patch_environment,
)


@pytest.fixture(autouse=True)
def _fresh_state():
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


# --- shared state and Accelerator attributes ----------------------------------------------------------------------


def test_gradient_state_is_shared_and_resettable() -> None:
    accelerator = Accelerator()
    state = GradientState()
    assert state.num_steps == 1 and state.sync_gradients
    accelerator.gradient_accumulation_steps = 4
    accelerator.sync_gradients = False
    assert state.num_steps == 4 and state.sync_gradients is False and accelerator.gradient_state.num_steps == 4
    GradientState._reset_state()
    assert GradientState().num_steps == 1 and GradientState().sync_gradients is True


def test_gradient_accumulation_steps_setter_refuses_bad_values() -> None:
    accelerator = Accelerator()
    with pytest.raises(ValueError, match=re.escape("gradient_accumulation_steps=0): expected an int >= 1")):
        accelerator.gradient_accumulation_steps = 0


def test_distributed_type_accepts_fsdp_and_refuses_others(monkeypatch) -> None:
    _no_fsdp_env(monkeypatch)
    accelerator = Accelerator()
    assert accelerator.distributed_type == "NO"  # one process, nothing asks for FSDP: Accelerate's type
    accelerator.state.distributed_type = "FSDP"  # as Accelerate's tests switch FSDP on
    assert accelerator.distributed_type == "FSDP" and AcceleratorState().distributed_type == "FSDP"
    assert AcceleratorState().fsdp_plugin is accelerator.fsdp_plugin
    with pytest.raises(ValueError, match=re.escape("accelerator.distributed_type = 'MULTI_GPU': fullshard shards")):
        accelerator.distributed_type = "MULTI_GPU"
    model = accelerator.prepare(nn.Linear(2, 2))
    assert is_sharded(model)
    with pytest.raises(ValueError, match=re.escape("= 'NO' after 1 model(s) were prepared as FSDP: set it before")):
        accelerator.distributed_type = "NO"


def test_prepared_objects_are_listed_and_marked() -> None:
    accelerator = Accelerator()
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    loader = DataLoader(list(range(4)), batch_size=2)
    other = [1, 2]
    model, optimizer, scheduler, loader, other = accelerator.prepare(model, optimizer, scheduler, loader, other)
    assert accelerator._optimizers == [optimizer] and accelerator._schedulers == [scheduler]
    assert accelerator._dataloaders == [loader] and accelerator._models == [model]
    for obj in (model, optimizer, scheduler, loader):
        assert obj._is_accelerate_prepared is True
    assert not hasattr(other, "_is_accelerate_prepared")


def test_accelerated_optimizer_pickles() -> None:
    accelerator = Accelerator()
    model = accelerator.prepare(nn.Linear(2, 2))
    optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    assert isinstance(optimizer, AcceleratedOptimizer)
    loaded = pickle.loads(pickle.dumps(optimizer))
    assert isinstance(loaded, AcceleratedOptimizer) and loaded.defaults["lr"] == 0.1
    assert loaded.gradient_state.num_steps == 1


def test_save_model_and_state_dict_of_an_unprepared_model(tmp_path) -> None:
    accelerator = Accelerator()
    model = nn.Linear(3, 2)
    state = accelerator.get_state_dict(model)
    assert set(state) == {"weight", "bias"} and torch.equal(state["weight"], model.weight)
    accelerator.save_model(model, tmp_path)
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "model.safetensors")["bias"], model.bias.detach())


def test_register_for_checkpointing_names_each_bad_item() -> None:
    accelerator = Accelerator()
    net = nn.Linear(1, 1)
    with pytest.raises(ValueError) as caught:
        accelerator.register_for_checkpointing(torch.tensor([1]), torch.tensor([2]), net)
    assert "Item at index 0 (Tensor)" in str(caught.value) and "Item at index 1 (Tensor)" in str(caught.value)
    assert "Item at index 2" not in str(caught.value)


def test_autocast_kwargs_disable_autocast_inside_the_block() -> None:
    accelerator = Accelerator(mixed_precision="bf16")
    a = torch.rand(4, 4)
    with accelerator.autocast():
        assert torch.mm(a, a).dtype == torch.bfloat16
        with accelerator.autocast(autocast_handler=AutocastKwargs(enabled=False)):
            assert torch.mm(a, a).dtype == torch.float32
    off = Accelerator(mixed_precision="bf16", kwargs_handlers=[AutocastKwargs(enabled=False)])
    with off.autocast():
        assert torch.mm(a, a).dtype == torch.float32


def test_find_executable_batch_size_keeps_the_size_it_reached() -> None:
    tried = []

    @find_executable_batch_size(starting_batch_size=10)
    def run(batch_size: int) -> int:
        tried.append(batch_size)
        if batch_size > 8:
            raise RuntimeError("CUDA out of memory.")
        return batch_size

    assert run() == 8 and run() == 8 and tried == [10, 9, 8, 8]  # int(10 * 0.9) = 9, int(9 * 0.9) = 8


# --- plugin values compare with torch's ---------------------------------------------------------------------------


def test_engine_enums_and_policies_equal_torch_ones_both_ways() -> None:
    import torch.distributed.fsdp as torch_fsdp

    assert torch_fsdp.ShardingStrategy.FULL_SHARD == ShardingStrategy.FULL_SHARD
    assert ShardingStrategy.FULL_SHARD == torch_fsdp.ShardingStrategy.FULL_SHARD
    assert ShardingStrategy.FULL_SHARD != torch_fsdp.ShardingStrategy.NO_SHARD
    assert BackwardPrefetch.BACKWARD_PRE == torch_fsdp.BackwardPrefetch.BACKWARD_PRE
    assert {StateDictType.SHARDED_STATE_DICT: 1}[torch_fsdp.StateDictType.SHARDED_STATE_DICT] == 1
    assert torch_fsdp.MixedPrecisionPolicy(torch.bfloat16) == MixedPrecisionPolicy(torch.bfloat16)
    assert MixedPrecisionPolicy(torch.bfloat16) != torch_fsdp.MixedPrecisionPolicy(torch.float16)
    assert torch_fsdp.CPUOffloadPolicy() == CPUOffloadPolicy()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=1, sharding_strategy="SHARD_GRAD_OP")
    assert plugin.sharding_strategy == torch_fsdp.ShardingStrategy(2)


def test_ram_efficient_loading_is_written_as_accelerate_writes_it() -> None:
    with patch_environment(fsdp_cpu_ram_efficient_loading="false"):
        enable_fsdp_ram_efficient_loading()
        assert os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "True"
        FullyShardedDataParallelPlugin(cpu_ram_efficient_loading=False)
        assert os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "False"


def test_compiled_module_checks_and_regional_compile_in_place() -> None:
    blocks = nn.Sequential(nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]), nn.Linear(2, 1))
    assert not is_compiled_module(blocks)
    assert is_compiled_module(torch.compile(blocks))
    same = compile_regions_fsdp2(blocks, backend="eager")
    assert same is blocks and all(getattr(m, "_compiled_call_impl", None) is not None for m in blocks[0])
    assert blocks[1]._compiled_call_impl is not None


# --- data loading -------------------------------------------------------------------------------------------------


def _shards(sampler, **kwargs) -> list[list[list[int]]]:
    return [list(BatchSamplerShard(sampler, 2, i, **kwargs)) for i in range(2)]


def test_batch_sampler_shard_completes_the_last_round_from_the_start() -> None:
    # 22 samples, batches of 3: the 8th batch is [21]; rank 1 completes it with the epoch's first samples.
    assert _shards(BatchSampler(range(22), 3, False)) == [
        [[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19, 20]],
        [[3, 4, 5], [9, 10, 11], [15, 16, 17], [21, 0, 1]],
    ]
    assert _shards(BatchSampler(range(2), 3, False)) == [[[0, 1, 0]], [[1, 0, 1]]]
    assert _shards(BatchSampler(range(22), 3, True)) == [
        [[0, 1, 2], [6, 7, 8], [12, 13, 14]],
        [[3, 4, 5], [9, 10, 11], [15, 16, 17]],
    ]
    assert _shards(BatchSampler(range(22), 3, False), even_batches=False)[1][-1] == [21]
    assert _shards(BatchSampler(range(8), 4, False), split_batches=True) == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    with pytest.raises(ValueError, match="round multiple of the number of processes"):
        BatchSamplerShard(BatchSampler(range(8), 3, False), 2, 0, split_batches=True)


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(10))


def test_iterable_dataset_shard_completes_with_the_first_elements() -> None:
    shards = [list(IterableDatasetShard(_Stream(), batch_size=2, num_processes=2, process_index=i)) for i in (0, 1)]
    assert shards == [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 0, 1]]


def test_loader_shard_and_dispatcher_flag_the_last_batch_each_epoch() -> None:
    for loader in (DataLoaderShard(range(16), batch_size=4), DataLoaderDispatcher(range(16), batch_size=4)):
        for _ in range(2):
            flags = [loader.end_of_dataloader for _ in loader]
            assert flags == [False, False, False, True]
        assert isinstance(loader, DataLoader) and loader.base_dataloader is loader
        assert [t.tolist() for t in skip_first_batches(loader, 2)] == [[8, 9, 10, 11], [12, 13, 14, 15]]
    assert [t.tolist() for t in SkipDataLoader(list(range(8)), batch_size=2, skip_batches=3)] == [[6, 7]]


def test_accelerator_deals_streams_and_custom_batch_samplers() -> None:
    accelerator = Accelerator()
    stream = accelerator.prepare_data_loader(DataLoader(_Stream(), batch_size=4))
    assert [t.tolist() for t in stream] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    custom = accelerator.prepare(DataLoader(list(range(6)), batch_sampler=[[0, 1, 2], [3], [4, 5]]))
    assert [t.tolist() for t in custom] == [[0, 1, 2], [3], [4, 5]]
    assert [t.tolist() for t in prepare_data_loader(DataLoader(list(range(4)), batch_size=2))] == [[0, 1], [2, 3]]


def _twice(values: list[int]) -> None:
    import torch.distributed as dist

    accelerator = Accelerator()
    assert accelerator.num_processes == 2 and dist.get_backend() == "gloo"
    got = gather(torch.tensor([accelerator.process_index * 2]))
    assert got.tolist() == values


def test_debug_launcher_runs_a_function_in_cpu_processes() -> None:
    debug_launcher(_twice, args=([0, 2],), num_processes=2)


# --- utilities ------------------------------------------------------------------------------------------------------


def test_cpu_offload_with_hook_moves_the_model_when_it_runs() -> None:
    first, hook1 = cpu_offload_with_hook(nn.Linear(2, 2), execution_device="meta")
    offloaded = []
    hook1.offload = lambda: offloaded.append(True)  # records the chained offload
    second, hook2 = cpu_offload_with_hook(nn.Linear(2, 2), execution_device="cpu", prev_module_hook=hook1)
    assert first.weight.device.type == "cpu"
    out = second(torch.ones(1, 2))
    assert offloaded == [True] and out.device.type == "cpu"
    hook2.remove()
    second(torch.ones(1, 2))
    assert offloaded == [True]


class _Named(GeneralTracker):
    name = "mirror_test_tracker"
    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs) -> None:
        super().__init__()
        self.run_name, self.values = run_name, {}

    @property
    def tracker(self):
        return self

    def log(self, values, step=None, **kwargs) -> None:
        self.values.update(values)


def test_register_tracker_class_makes_a_name_usable() -> None:
    saved = dict(LOGGER_TYPE_TO_CLASS)
    try:
        register_tracker_class(_Named)
        assert LOGGER_TYPE_TO_CLASS["mirror_test_tracker"] is _Named
        accelerator = Accelerator(log_with="mirror_test_tracker")
        accelerator.init_trackers("run")
        accelerator.log({"loss": 1.5}, step=0)
        assert accelerator.get_tracker("mirror_test_tracker").values == {"loss": 1.5}
        with pytest.raises(ValueError, match="subclass of GeneralTracker"):
            register_tracker_class(dict)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            register_tracker_class(type("Shadow", (_Named,), {}))
        assert "replaces _Named" in str(caught[0].message)
    finally:
        LOGGER_TYPE_TO_CLASS.clear()
        LOGGER_TYPE_TO_CLASS.update(saved)


def test_small_helpers() -> None:
    assert is_fp16_available() is True
    assert accelerate_constants.BETA_CP_AVAILABLE_PYTORCH_VERSION == "2.6.0"
    assert find_device([1, {"a": torch.ones(1)}]) == torch.device("cpu") and find_device([1, "a"]) is None
    assert pad_input_tensors(torch.ones(61, 2), 61, 6).shape == (66, 2)
    assert pad_input_tensors(torch.ones(1, 2), 1, 6)[1:].abs().sum() == 0
    assert convert_dict_to_env_variables({"A": "1", "B": "<x", "C": "2"}) == ["A=1\n", "C=2\n"]
    os.environ["MIRROR_TEST_VAR"] = "1"
    try:
        with clear_environment():
            assert "MIRROR_TEST_VAR" not in os.environ
            os.environ["OTHER_MIRROR_VAR"] = "2"
        assert os.environ["MIRROR_TEST_VAR"] == "1" and "OTHER_MIRROR_VAR" not in os.environ
    finally:
        del os.environ["MIRROR_TEST_VAR"]


def test_preparing_a_model_twice_lists_it_once() -> None:
    accelerator = Accelerator()
    model = accelerator.prepare(nn.Linear(2, 2))
    assert accelerator.prepare(model) is model and accelerator._models == [model]


def test_safe_save_drops_tensors_that_share_memory(tmp_path, caplog) -> None:
    from safetensors.torch import load_file

    from fullshard.utils import save

    tied = nn.Module()
    tied.a = nn.Linear(2, 2)
    tied.b = tied.a
    with caplog.at_level("WARNING"):
        save(tied.state_dict(), tmp_path / "m.safetensors", safe_serialization=True)
    loaded = load_file(tmp_path / "m.safetensors")
    assert sorted(loaded) == ["a.bias", "a.weight"] and torch.equal(loaded["a.weight"], tied.a.weight.detach())
    assert [r.message.count("Removed shared tensor") for r in caplog.records] == [1]


def test_an_accelerator_fills_the_partial_state() -> None:
    from fullshard.accelerate.state import PartialState

    PartialState._reset_state()
    assert PartialState._shared_state == {}
    accelerator = Accelerator()
    assert PartialState().process_index == accelerator.process_index and PartialState._shared_state != {}


def test_accelerator_answers_through_its_shared_state_until_it_is_reset() -> None:
    """Accelerate's ``accelerator.state`` is the shared ``AcceleratorState``: attributes set on it are shared, and
    after ``AcceleratorState._reset_state()`` the accelerator's process fields raise Accelerate's error (naming
    the reset) until a new Accelerator is built."""
    accelerator = Accelerator()
    assert isinstance(accelerator.state, AcceleratorState) and accelerator.state.num_processes == 1
    accelerator.state.someotherthing = "MyValue"
    assert AcceleratorState().someotherthing == "MyValue"
    accelerator.state._reset_state()
    for name in ("num_processes", "process_index", "device", "is_main_process", "distributed_type"):
        with pytest.raises(AttributeError) as info:
            getattr(accelerator, name)
        assert str(info.value) == (
            f"`AcceleratorState` object has no attribute `{name}`. This happens if `AcceleratorState._reset_state()` "
            "was called and an `Accelerator` or `PartialState` was not reinitialized."
        )
    again = Accelerator()
    assert accelerator.num_processes == again.num_processes == 1  # a new Accelerator filled the state again


@pytest.mark.parametrize("cls_name", ["PartialState", "AcceleratorState"])
def test_shared_state_errors_use_accelerates_words(cls_name: str) -> None:
    from fullshard.accelerate import state as accelerate_state

    cls = getattr(accelerate_state, cls_name)
    Accelerator()
    state = cls()
    assert state.num_processes == 1
    with pytest.raises(AttributeError) as info:
        state.someotherthing  # noqa: B018
    assert str(info.value) == f"'{cls_name}' object has no attribute 'someotherthing'"
    cls._reset_state()
    with pytest.raises(AttributeError) as info:
        state.num_processes  # noqa: B018
    assert str(info.value) == (
        f"`{cls_name}` object has no attribute `num_processes`. This happens if `{cls_name}._reset_state()` was "
        "called and an `Accelerator` or `PartialState` was not reinitialized."
    )
    state.someotherthing = "MyValue"  # a reset state still takes attributes
    assert state.someotherthing == "MyValue"


def test_scheduler_follows_the_optimizers_skip_flag() -> None:
    accelerator = Accelerator()
    model = nn.Linear(2, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lambda n: 1 - n / 10)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    optimizer._is_overflow = False  # Accelerate's flag: the last step ran
    scheduler.step()
    assert scheduler.get_last_lr()[0] == 0.9
    optimizer._is_overflow = True  # the last step was skipped: the scheduler does not step either
    scheduler.step()
    assert scheduler.get_last_lr()[0] == 0.9 and accelerator.optimizer_step_was_skipped


def test_extract_model_looks_through_a_compiled_wrapper_as_accelerate() -> None:
    from accelerate.utils import extract_model_from_parallel as accelerate_extract

    from fullshard.accelerate.utils import extract_model_from_parallel

    torch.manual_seed(0)
    model = nn.Linear(2, 4)
    compiled = torch.compile(nn.DataParallel(model))
    x = torch.randn(3, 2)
    for keep in (True, False):
        ours = extract_model_from_parallel(compiled, keep_torch_compile=keep)
        theirs = accelerate_extract(torch.compile(nn.DataParallel(model)), keep_torch_compile=keep)
        assert type(ours) is type(theirs) and getattr(ours, "_orig_mod", ours) is getattr(theirs, "_orig_mod", theirs)
        assert torch.equal(ours(x), model(x))  # the compiled module calls the unwrapped model
    assert compiled._orig_mod.module is model  # the wrapper given is left as it was
    assert Accelerator().unwrap_model(compiled) is model  # keep_torch_compile=None: unwrapped, as Accelerate


def test_accelerate_torch_device_names_the_device() -> None:
    from fullshard.accelerate.state import PartialState

    PartialState._reset_state()
    with patch_environment(ACCELERATE_TORCH_DEVICE="cpu:3"):
        assert str(Accelerator().device) == "cpu:3"
        PartialState._reset_state()
        assert str(PartialState().device) == "cpu:3"
    PartialState._reset_state()
    assert str(Accelerator().device) == "cpu"
    bad = pytest.raises(ValueError, match=re.escape("ACCELERATE_TORCH_DEVICE='gpu7': not a torch device"))
    with patch_environment(ACCELERATE_TORCH_DEVICE="gpu7"), bad:
        Accelerator()


def test_env_file_warnings_go_to_accelerates_logger(caplog) -> None:
    from fullshard.accelerate.utils.environment import convert_dict_to_env_variables as mirrored

    with caplog.at_level("WARNING", logger="accelerate.utils.environment"):
        assert mirrored({"A": "1", "B": "<x"}) == ["A=1\n"]
    assert [r.name for r in caplog.records] == ["accelerate.utils.environment"]
    assert "B=<x" in caplog.records[0].getMessage()


def test_build_device_mesh_asks_torch_for_the_mesh_accelerate_asks_for() -> None:
    from unittest.mock import MagicMock, patch

    from accelerate import ParallelismConfig as AccelerateConfig

    from fullshard import ParallelismConfig

    def calls(config_class: type) -> list:
        seen: list = []

        def init_mesh(device_type, mesh_shape, mesh_dim_names):
            seen.append((device_type, tuple(mesh_shape), tuple(mesh_dim_names)))
            mesh = MagicMock()
            mesh.__getitem__.side_effect = lambda dims: MagicMock(_flatten=lambda name: seen.append((dims, name)))
            return mesh

        with patch("torch.distributed.device_mesh.init_device_mesh", side_effect=init_mesh):
            config_class(dp_replicate_size=2, dp_shard_size=2, tp_size=2).build_device_mesh("cpu")
        return seen

    ours = calls(ParallelismConfig)
    assert ours == calls(AccelerateConfig)
    assert ours[0] == ("cpu", (2, 2, 2), ("dp_replicate", "dp_shard", "tp"))


def test_prepared_loader_is_a_data_loader_shard_and_pickles_with_the_accelerator() -> None:
    from fullshard import skip_first_batches

    loader = DataLoader(torch.arange(10), batch_size=2)
    accelerator = Accelerator()
    prepared, _ = accelerator.prepare(loader, skip_first_batches(loader, 2))
    assert isinstance(prepared, DataLoaderShard) and isinstance(
        accelerator.skip_first_batches(prepared), DataLoaderShard
    )
    loaded = pickle.loads(pickle.dumps(accelerator))._dataloaders
    expected = [b.tolist() for b in loader]
    assert [b.tolist() for b in loaded[0]] == [b.tolist() for b in prepared] == expected
    assert [b.tolist() for b in loaded[1]] == expected[2:] and len(loaded[1]) == len(prepared) - 2
    batches = iter(prepared)
    flags = [prepared.end_of_dataloader for _ in batches]
    assert flags == [False] * 4 + [True] and prepared.end_of_dataloader is False


def test_module_unwrapped_from_a_one_process_wrapper_computes_with_its_weights() -> None:
    import copy

    torch.manual_seed(0)
    model = nn.Linear(2, 4)
    reference = copy.deepcopy(model)
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=1))
    prepared = accelerator.prepare(model)
    assert isinstance(prepared, FullyShardedDataParallel)
    optimizer = accelerator.prepare(torch.optim.SGD(prepared.parameters(), lr=0.1))
    x = torch.randn(10, 2)
    accelerator.backward(prepared(x).sum())
    optimizer.step()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference(x).sum().backward()
    reference_optimizer.step()
    out = prepared(x)
    torch.testing.assert_close(out, reference(x))
    unwrapped = accelerator.unwrap_model(prepared, keep_fp32_wrapper=False)
    assert torch.equal(unwrapped(x), out)  # the one rank's shards are the whole (updated) weights
    assert torch.equal(pickle.loads(pickle.dumps(unwrapped))(x), out)


# --- one process without FSDP: Accelerate's DistributedType.NO ----------------------------------------------------


def _no_fsdp_env(monkeypatch) -> None:
    for name in [n for n in os.environ if n.startswith(("FSDP_", "ACCELERATE_USE_"))]:
        monkeypatch.delenv(name)


def _parts():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1), torch.randn(6, 4)


def test_one_process_without_fsdp_trains_the_model_as_it_is(monkeypatch) -> None:
    """Accelerate's ``DistributedType.NO``: ``prepare`` returns the very model (hooks and attribute writes on the
    user's object count), autocast for mixed precision, and a step equal to plain torch's to the bit."""
    _no_fsdp_env(monkeypatch)
    model, optimizer, x = _parts()
    reference, reference_optimizer, _ = _parts()
    accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=2)
    prepared, prepared_optimizer = accelerator.prepare(model, optimizer)
    assert prepared is model and not is_sharded(model)
    assert accelerator.distributed_type == "NO" and not accelerator.is_fsdp2
    assert AcceleratorState().distributed_type == "NO" and AcceleratorState().fsdp_plugin is None  # the Trainer's test
    for step in range(2):
        with accelerator.accumulate(prepared):
            out = prepared(x[3 * step : 3 * step + 3])
            assert out.dtype == torch.float32
            accelerator.backward(out.square().mean())
            norm = accelerator.clip_grad_norm_(prepared.parameters(), 0.5)
            prepared_optimizer.step()
            prepared_optimizer.zero_grad()
    for step in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = reference(x[3 * step : 3 * step + 3])
        (out.float().square().mean() / 2).backward()
    expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    reference_optimizer.step()
    assert torch.equal(norm, expected_norm)
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    assert accelerator.unwrap_model(prepared) is model
    assert accelerator.get_state_dict(prepared).keys() == reference.state_dict().keys()


@pytest.mark.parametrize("layout", ["FULL_STATE_DICT", "SHARDED_STATE_DICT"])
def test_one_process_checkpoint_without_fsdp_loads_as_it_is_and_sharded(monkeypatch, tmp_path, layout) -> None:
    """``save_state`` of a model prepared as it is round-trips the model and the optimizer, and its folder is the
    sharded layout: a sharded run (here one rank under a plugin) resumes from it to the same numbers."""
    _no_fsdp_env(monkeypatch)
    model, optimizer, x = _parts()
    accelerator = Accelerator()
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.backward(model(x).square().mean())
    optimizer.step()
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_optimizer = {k: v.clone() for k, v in optimizer.state_dict()["state"][0].items()}
    accelerator.fsdp_plugin.set_state_dict_type(layout)  # the layout save_state writes
    accelerator.save_state(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / ("pytorch_model_fsdp.bin" if layout == "FULL_STATE_DICT" else "optimizer_0")).exists()
    optimizer.step()  # moves the weights and Adam's state on
    optimizer.zero_grad()
    accelerator.load_state(tmp_path / "ckpt")
    assert all(torch.equal(v, saved_model[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(v, saved_optimizer[k]) for k, v in optimizer.state_dict()["state"][0].items())
    accelerator.backward(model(x).square().mean())
    optimizer.step()
    expected = model(x)

    AcceleratorState._reset_state(True)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=layout)
    sharded_accelerator = Accelerator(fsdp_plugin=plugin)
    other, other_optimizer, _ = _parts()
    other, other_optimizer = sharded_accelerator.prepare(other, other_optimizer)
    assert is_sharded(other)
    sharded_accelerator.load_state(tmp_path / "ckpt")
    sharded_accelerator.backward(other(x).square().mean())
    other_optimizer.step()
    torch.testing.assert_close(other(x), expected)
    sharded_accelerator.save_state(tmp_path / "sharded")  # and back: the sharded run's folder into a plain model
    expected = sharded_accelerator.get_state_dict(other)

    AcceleratorState._reset_state(True)
    plain_accelerator = Accelerator()
    plain, plain_optimizer, _ = _parts()
    plain, plain_optimizer = plain_accelerator.prepare(plain, plain_optimizer)
    plain_accelerator.fsdp_plugin.set_state_dict_type(layout)
    plain_accelerator.load_state(tmp_path / "sharded")
    assert not is_sharded(plain) and all(torch.equal(v, expected[k]) for k, v in plain.state_dict().items())
    assert plain_optimizer.state_dict()["state"][0]["step"] == 2


def test_fsdp_asked_for_shards_one_process(monkeypatch) -> None:
    """A plugin, ``ACCELERATE_USE_FSDP=true`` or an ``FSDP_*`` variable (with ``ACCELERATE_USE_FSDP`` unset) shard
    one process as before; ``ACCELERATE_USE_FSDP=false`` wins over the ``FSDP_*`` variables."""
    _no_fsdp_env(monkeypatch)
    assert is_sharded(Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin()).prepare(nn.Linear(2, 2)))
    for variables, sharded in [
        ({"ACCELERATE_USE_FSDP": "true"}, True),
        ({"FSDP_VERSION": "2"}, True),
        ({"FSDP_VERSION": "2", "ACCELERATE_USE_FSDP": "false"}, False),
    ]:
        AcceleratorState._reset_state(True)
        with patch_environment(**variables):
            accelerator = Accelerator()
            assert is_sharded(accelerator.prepare(nn.Linear(2, 2))) is sharded, variables
            assert accelerator.distributed_type == ("FSDP" if sharded else "NO")
