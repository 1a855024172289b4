"""Memory budgets and device maps: where each layer of a model goes when it does not fit on one device.

[Note: device map]
:func:`infer_auto_device_map` walks the model's direct entries (its own parameters, its children, its own
buffers) in order and fills the devices of ``max_memory`` in order (accelerators by index, then ``"mps"``,
``"cpu"``, then ``"disk"``, which has no limit):

- an entry that fits in what is left of the current device goes there;
- one that does not is replaced by its own entries (it is split), unless it has none or its class is in
  ``no_split_module_classes``; then the next device is taken;
- the first accelerator and the CPU keep room for the largest remaining unsplittable layer (a layer offloaded
  further down must be brought back to run), so their usable budget is their limit minus that size;
- parameters tied across entries count with, and go with, the entry that meets them first.

With ``clean_result`` the map is compacted: a module whose entries all went to one device appears once. The
result matches Accelerate's for the same model and budgets (tests compare them), with one deliberate
difference: a split module's own buffers are listed too (Accelerate leaves them out of the map).
"""

from __future__ import annotations

import os
from collections import OrderedDict, defaultdict
from typing import Any

import torch
from torch import nn

from fullshard.checkpoint import parse_size
from fullshard.frontend.bigmodel.tied import find_tied_parameters

__all__ = [
    "compute_module_sizes",
    "clean_device_map",
    "get_balanced_memory",
    "get_max_layer_size",
    "get_max_memory",
    "infer_auto_device_map",
]

Entry = tuple[str, Any]  # (full name, module or tensor)


def compute_module_sizes(
    model: nn.Module, dtype: str | torch.dtype | None = None, special_dtypes: dict[str, Any] | None = None
) -> dict[str, int]:
    """Bytes of the parameters and buffers under every module name ("" is the whole model).

    ``dtype`` counts floating-point tensors at that dtype's size (as if cast); ``special_dtypes`` maps a tensor
    name to the dtype to count it at.
    """

    def size_of(name: str, tensor: torch.Tensor) -> int:
        target = (special_dtypes or {}).get(name, dtype)
        if isinstance(target, str):
            target = getattr(torch, target.replace("torch.", ""))
        if target is not None and tensor.is_floating_point():
            return tensor.numel() * torch.empty((), dtype=target).element_size()
        return tensor.numel() * tensor.element_size()

    sizes: dict[str, int] = defaultdict(int)
    tensors = [*model.named_parameters(remove_duplicate=True), *model.named_buffers(remove_duplicate=True)]
    for name, tensor in tensors:
        size = size_of(name, tensor)
        parts = name.split(".")
        for i in range(len(parts) + 1):
            sizes[".".join(parts[:i])] += size
    return dict(sizes)


def get_max_layer_size(
    modules: list[Entry], module_sizes: dict[str, int], no_split_module_classes: list[str]
) -> tuple[int, list[str]]:
    """The largest unsplittable layer under ``modules`` (a module without children, or of a no-split class):
    its size and the names of every layer of that size, in model order."""
    best, names = 0, []
    pending = list(modules)
    while pending:
        name, module = pending.pop(0)
        children = list(module.named_children()) if isinstance(module, nn.Module) else []
        if children and type(module).__name__ not in no_split_module_classes:
            pending = [(f"{name}.{n}", c) for n, c in children] + pending
            continue
        size = module_sizes.get(name, 0)  # modules without tensors (an activation) are not listed
        if size > best:
            best, names = size, [name]
        elif size == best:
            names.append(name)
    return best, names


def _available_ram() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def get_max_memory(max_memory: dict[int | str, int | str] | None = None) -> dict[int | str, int]:
    """Bytes per device: free memory of every CUDA device and available RAM when ``max_memory`` is ``None``;
    else ``max_memory`` with sizes like ``"2GB"`` converted, ordered accelerators, ``mps``, ``cpu``, ``disk``."""
    if max_memory is None:
        found: dict[int | str, int] = {i: torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())}
        found["cpu"] = _available_ram()
        return found
    parsed = {k: parse_size(v, arg=f"max_memory[{k!r}]") if isinstance(v, str) else v for k, v in max_memory.items()}
    unknown = [k for k in parsed if not (isinstance(k, int) or k in ("mps", "cpu", "disk"))]
    if unknown:
        raise ValueError(
            f"max_memory: device {unknown[0]!r} is not recognised. Use integers for accelerators (0 is cuda:0), "
            "'mps', 'cpu' and 'disk'."
        )
    order = sorted(k for k in parsed if isinstance(k, int)) + [k for k in ("mps", "cpu", "disk") if k in parsed]
    return {k: parsed[k] for k in order}


def _no_split(classes: Any) -> list[str]:
    if classes is None:
        return []
    return [classes] if isinstance(classes, str) else list(classes)


def _leaves(names: list[str]) -> list[str]:
    parents = {n.rpartition(".")[0] for n in names if "." in n}
    return [n for n in names if n and n not in parents]


def get_balanced_memory(
    model: nn.Module,
    max_memory: dict[int | str, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: str | torch.dtype | None = None,
    special_dtypes: dict[str, Any] | None = None,
    low_zero: bool = False,
) -> dict[int | str, int]:
    """A ``max_memory`` for :func:`infer_auto_device_map` that spreads the model evenly over the accelerators.

    Each accelerator but the last is capped at ``model size / n`` plus a margin (1.25 x the larger of the
    biggest no-split block and the mean size of the lowest modules), so layers do not spill to the CPU; the
    last keeps its full budget. ``low_zero`` puts as little as possible on accelerator 0. With one accelerator
    and no ``max_memory`` given, 90% of its free memory is offered (the rest is working room).
    """
    user_given = max_memory is not None
    budget: dict[int | str, Any] = get_max_memory(max_memory)
    accelerators = sorted(k for k, v in budget.items() if isinstance(k, int) and v > 0)
    if not accelerators:
        return budget
    if len(accelerators) == 1:
        low_zero = False
        if not user_given:
            budget[accelerators[0]] *= 0.9
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    per_device = sizes[""] // (len(accelerators) - 1 if low_zero else len(accelerators))
    classes = _no_split(no_split_module_classes)
    block = max((sizes[n] for n, m in model.named_modules() if n and type(m).__name__ in classes), default=0)
    module_names = [n for n in sizes if n not in set(_leaves(list(sizes)))]
    lowest = _leaves(module_names)
    mean = int(sum(sizes[n] for n in lowest) / max(len(lowest), 1))
    per_device += int(1.25 * max(block, mean))
    for index in accelerators[:-1]:
        budget[index] = min(budget[0] if low_zero and index == 0 else per_device, budget[index])
    if low_zero:
        rest = sum(budget[i] for i in range(1, len(accelerators)))
        budget[0] = min(max(0, sizes[""] - rest), budget[0])
    return budget


def _entries(module: nn.Module, prefix: str, *, buffers: bool = True) -> list[Entry]:
    own = [*module.named_parameters(recurse=False), *module.named_children()]
    own += list(module.named_buffers(recurse=False)) if buffers else []
    return [(f"{prefix}{n}", v) for n, v in own]


def _splittable(obj: Any, classes: list[str]) -> bool:
    return isinstance(obj, nn.Module) and bool(list(obj.children())) and type(obj).__name__ not in classes


def _inside(name: str, entry: str) -> bool:
    return name == entry or name.startswith(entry + ".")


class _Planner:
    """State of one :func:`infer_auto_device_map` run (see [Note: device map])."""

    def __init__(self, model: nn.Module, budget: dict[Any, int], classes: list[str], sizes: dict[str, int]) -> None:
        self.devices = [*budget, *(["disk"] if "disk" not in budget else [])]
        accelerators = [d for d in self.devices if d not in ("cpu", "disk")]
        if "mps" in accelerators:
            self.reserving = {"mps"}
        else:
            self.reserving = {accelerators[0], "cpu"} if accelerators else {"cpu"}
        self.budget, self.classes = budget, classes
        self.sizes: dict[str, int] = defaultdict(int, sizes)  # tensor-free modules (activations) weigh 0
        self.ties = find_tied_parameters(model)
        self.queue: list[Entry] = _entries(model, "")
        self.used = dict.fromkeys(self.devices, 0)
        self.device_map: OrderedDict[str, Any] = OrderedDict()
        self.largest, self.largest_names = 0, []
        self._measure()

    def _measure(self) -> None:
        modules = [(n, m) for n, m in self.queue if isinstance(m, nn.Module)]
        self.largest, self.largest_names = get_max_layer_size(modules, self.sizes, self.classes)

    def _tied_partners(self, name: str) -> list[tuple[str, str]]:
        """(partner parameter, queue entry holding it) for parameters tied to one inside ``name`` but outside."""
        pairs = []
        for group in self.ties:
            inside = [p for p in group if _inside(p, name)]
            if inside and len(inside) < len(group):
                for partner in (p for p in group if not _inside(p, name)):
                    entry = next((n for n, _ in self.queue if _inside(partner, n)), None)
                    if entry is not None and (partner, entry) not in pairs:
                        pairs.append((partner, entry))
        return pairs

    def _split(self, name: str, obj: nn.Module, at: int) -> None:
        self.queue[at : at + 1] = _entries(obj, f"{name}.")
        self._measure()

    def step(self, device_index: int) -> int:
        """Place the next queue entry, split it, or move on; returns the device index to use next."""
        name, obj = self.queue.pop(0)
        self.largest_names = [n for n in self.largest_names if not _inside(n, name)]
        if not self.largest_names:
            self._measure()
        device = self.devices[device_index]
        reserved = self.largest if device in self.reserving else 0
        limit = None if device == "disk" else self.budget[device] - reserved
        partners = self._tied_partners(name)
        entries = list(dict.fromkeys(e for _, e in partners))
        with_ties = self.sizes[name] + sum(self.sizes[e] - self.sizes[p] for p, e in partners)
        if limit is None or self.used[device] + with_ties <= limit:
            self.used[device] += with_ties
            self.device_map[name] = device
            for entry in entries:
                self.queue = [(n, m) for n, m in self.queue if n != entry]
                self.device_map[entry] = device
            return device_index
        if partners and self.used[device] + self.sizes[name] <= limit:
            for entry in entries:
                at, module = next((i, m) for i, (n, m) in enumerate(self.queue) if n == entry)
                if _splittable(module, self.classes):
                    self._split(entry, module, at)
                    self.queue.insert(0, (name, obj))
                    return device_index
        if self.used[device] + self.sizes[name] >= limit and _splittable(obj, self.classes):
            self.queue.insert(0, (name, obj))
            self._split(name, obj, 0)
            return device_index
        self.queue.insert(0, (name, obj))
        return device_index + 1


def infer_auto_device_map(
    model: nn.Module,
    max_memory: dict[int | str, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: str | torch.dtype | None = None,
    special_dtypes: dict[str, Any] | None = None,
    verbose: bool = False,
    clean_result: bool = True,
    offload_buffers: bool = False,
    fallback_allocation: bool = False,
) -> OrderedDict[str, Any]:
    """A map from module (or tensor) names to devices; see [Note: device map]. The model may be on ``meta``.

    ``verbose``, ``offload_buffers`` and ``fallback_allocation`` are accepted for compatibility and unused.
    """
    budget = get_max_memory(max_memory)
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    planner = _Planner(model, budget, _no_split(no_split_module_classes), sizes)
    device_index = 0
    while planner.queue:
        device_index = planner.step(device_index)
    return clean_device_map(planner.device_map) if clean_result else planner.device_map


def clean_device_map(device_map: dict[str, Any], module_name: str = "") -> dict[str, Any]:
    """Merge the entries under ``module_name`` into one when they all go to the same device, recursively."""
    prefix = f"{module_name}." if module_name else ""
    under = [k for k in device_map if k.startswith(prefix)]
    values = {str(device_map[k]) for k in under}
    if len(under) > 1 and len(values) == 1:
        value = device_map[under[0]]
        for key in under:
            del device_map[key]
        device_map[module_name] = value
        return device_map
    depth = len(module_name.split(".")) + 1 if module_name else 1
    children = {".".join(k.split(".")[:depth]) for k in under if len(k) > len(module_name)}
    for child in sorted(children):
        clean_device_map(device_map, child)
    return device_map
