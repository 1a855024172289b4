"""Whether this CPU computes in bf16 natively, and the one warning when a policy asks for bf16 compute without it.

Without native bf16 instructions (x86 with AVX2 only: no AVX-512 BF16, no AMX) torch emulates bf16 matmuls
by converting to fp32 and back, which measured several times slower than fp32 compute (see
``docs/benchmarks.md``, "Mixed precision on CPU"). The fix is to compute in fp32 and keep bf16 only where it
pays, on the wire: ``reduce_dtype=torch.bfloat16`` without ``param_dtype``, or a bf16 compression comm hook;
or plain fp32. Capabilities come from ``torch.cpu.get_capabilities()`` (torch's cpuinfo probe, public since
torch 2.7); an architecture it does not describe counts as native, so it is never warned about wrongly.

Invariant: :func:`warn_if_slow_bf16` warns at most once per process, on rank 0 only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fullshard.ranks import warn_rank0

__all__ = ["cpu_capabilities", "has_native_bf16", "warn_if_slow_bf16"]

_X86 = ("x86_64", "x86", "amd64", "i386", "i686")
_warned = False


def cpu_capabilities() -> Mapping[str, Any]:
    """torch's view of this CPU (``torch.cpu.get_capabilities()``), or an empty mapping on older torch."""
    probe = getattr(torch.cpu, "get_capabilities", None)
    return probe() if probe is not None else {}


def has_native_bf16(caps: Mapping[str, Any] | None = None) -> bool:
    """True when the CPU has bf16 arithmetic (AVX-512 BF16 or AMX-BF16 on x86; BF16/SVE-BF16 on ARM64)."""
    caps = cpu_capabilities() if caps is None else caps
    arch = str(caps.get("architecture", "")).lower()
    if arch in _X86:
        return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))
    if arch in ("aarch64", "arm64"):
        return bool(caps.get("bf16") or caps.get("sve_bf16"))
    return True


def warn_if_slow_bf16(param_dtype: torch.dtype | None, device: torch.device) -> None:
    """Warn (once per process, rank 0) when units will compute in bf16 on a CPU that emulates it."""
    global _warned
    if _warned or param_dtype is not torch.bfloat16 or device.type != "cpu" or has_native_bf16():
        return
    _warned = True
    caps = cpu_capabilities()
    warn_rank0(
        f"param_dtype=torch.bfloat16 computes in bf16 on the CPU, but this CPU ({caps.get('cpu_name', 'unknown')}, "
        f"torch capability {torch.backends.cpu.get_cpu_capability()}) has no native bf16 instructions (neither "
        "AVX-512 BF16 nor AMX), so every bf16 matmul is emulated and runs several times slower than fp32. Compute in "
        "fp32 and keep bf16 on the wire instead: MixedPrecision(reduce_dtype=torch.bfloat16) without param_dtype (or "
        "a bf16 compression comm hook), or leave mixed precision off.",
        stacklevel=4,
    )
