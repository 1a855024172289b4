"""bf16 compute on a CPU without native bf16: one warning naming the fix, and none where bf16 is native.

The capability probe (``torch.cpu.get_capabilities``) is replaced both ways, so the test means the same on
an AVX2-only machine and on one with AMX.
"""

from __future__ import annotations

import platform
import warnings

import pytest
import torch

import fullshard.engine.cpu_bf16 as cpu_bf16
from fullshard import FSDP, MixedPrecision, MixedPrecisionPolicy, fully_shard
from fullshard.testing import WorkerPool
from fullshard.testing.bench import cpu_flags
from fullshard.testing.models import Block, GPTConfig, TinyGPT
from fullshard.wrap import ModuleWrapPolicy

AVX2_ONLY = {"architecture": "x86_64", "cpu_name": "AMD EPYC", "avx2": True, "avx512_bf16": False, "amx_bf16": False}
AMX = {"architecture": "x86_64", "cpu_name": "Xeon", "avx2": True, "avx512_bf16": True, "amx_bf16": True}


@pytest.mark.parametrize(
    "caps, native",
    [
        (AVX2_ONLY, False),
        (AMX, True),
        ({**AVX2_ONLY, "amx_bf16": True}, True),
        ({"architecture": "aarch64", "neon": True, "bf16": False, "sve_bf16": False}, False),
        ({"architecture": "aarch64", "bf16": True}, True),
        ({"architecture": "riscv64"}, True),  # undescribed: never warned about wrongly
    ],
)
def test_native_bf16_from_capabilities(caps: dict, native: bool) -> None:
    assert cpu_bf16.has_native_bf16(caps) is native


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="the kernel's x86 flag names")
def test_this_machine_is_probed_as_the_kernel_reports_it() -> None:
    """torch's cpuinfo probe (what the warning trusts) and the kernel's ``/proc/cpuinfo`` flags agree on this CPU."""
    flags = cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags on this machine")
    assert cpu_bf16.has_native_bf16() is bool({"avx512_bf16", "amx_bf16"} & flags), (cpu_bf16.cpu_capabilities(), flags)


def _wrap_twice(rank: int, world: int, caps: dict, entry: str, param_dtype: torch.dtype | None) -> list[str]:
    saved = cpu_bf16.cpu_capabilities, cpu_bf16._warned
    cpu_bf16.cpu_capabilities, cpu_bf16._warned = (lambda: caps), False
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):  # two models of three units each: still one warning
                model = TinyGPT(GPTConfig())
                if entry == "FSDP":
                    mp = MixedPrecision(param_dtype=param_dtype, reduce_dtype=torch.bfloat16)
                    FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), mixed_precision=mp)
                else:
                    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.bfloat16)
                    for block in model.blocks:
                        fully_shard(block, mp_policy=policy)
                    fully_shard(model, mp_policy=policy)
        return [str(w.message) for w in caught if "no native bf16" in str(w.message)]
    finally:
        cpu_bf16.cpu_capabilities, cpu_bf16._warned = saved


@pytest.mark.parametrize("entry", ["FSDP", "fully_shard"])
def test_bf16_compute_without_native_bf16_warns_once_on_rank0(pool2: WorkerPool, entry: str) -> None:
    rank0, rank1 = pool2.run(_wrap_twice, AVX2_ONLY, entry, torch.bfloat16)
    assert len(rank0) == 1 and rank1 == []
    assert "AMD EPYC" in rank0[0]
    assert "MixedPrecision(reduce_dtype=torch.bfloat16) without param_dtype" in rank0[0]


@pytest.mark.parametrize(
    "caps, param_dtype",
    [(AMX, torch.bfloat16), (AVX2_ONLY, None), (AVX2_ONLY, torch.float16)],
    ids=["native-bf16", "fp32-compute-bf16-reduce", "fp16"],
)
def test_no_warning_where_bf16_compute_is_not_emulated(pool2: WorkerPool, caps: dict, param_dtype) -> None:
    assert pool2.run(_wrap_twice, caps, "FSDP", param_dtype) == [[], []]
