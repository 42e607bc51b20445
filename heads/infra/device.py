"""The one device decision, shared by every verb (data, train, eval, bench, export, quickstart).

`resolve_device("auto")` is `cuda` when a CUDA device is present, else `cpu`;
any other name (`cpu`, `cuda`, `cuda:1`, `mps`) is checked against what this
machine has, and a device it lacks is an error that lists the ones it has.
Recipes set it with `target.device=`, the eval/bench/export verbs with
`--device`.  Every Target.load, drafter, feature batch and engine cache is
placed on the device this function returns (the placement test in
tests/test_device.py holds the code to that).

Timing on an asynchronous device (CUDA) must wait for the queued kernels:
`synchronize(device)` does, and is a no-op on the CPU.
"""
from __future__ import annotations

import os

import torch


class DeviceError(ValueError):
    """A device this machine does not have."""


def available_devices() -> list[str]:
    """The device names this machine can run on, e.g. ['cpu', 'cuda:0', 'cuda:1']."""
    names = ["cpu"]
    if torch.cuda.is_available():
        names += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        names.append("mps")
    return names


def resolve_device(name: str | torch.device | None = "auto") -> torch.device:
    """'auto' (or None): cuda when present, else cpu.  Anything else is checked to exist here."""
    if isinstance(name, torch.device):
        name = str(name)
    if name in (None, "", "auto"):
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as err:
        raise DeviceError(f"device '{name}' is not a device name ({err}); use auto, cpu, cuda or cuda:N "
                          f"(this machine has {available_devices()})") from None
    if device.type == "cpu":
        return device
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (device.index is not None and device.index >= count):
            raise DeviceError(f"device '{name}' is not on this machine (it has {available_devices()}); "
                              "set target.device=auto (or --device auto) to use what is there")
        return device
    if device.type == "mps" and "mps" in available_devices():
        return device
    if device.type == "meta":
        return device
    raise DeviceError(f"device '{name}' is not on this machine (it has {available_devices()})")


DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def check_device_map(device_map):
    """A target's `device_map` for transformers' big-model loading: one of DEVICE_MAP_STRATEGIES, or a
    mapping {module name: device} whose every device is on this machine ('disk' offloads)."""
    if device_map is None:
        return None
    if isinstance(device_map, str):
        if device_map not in DEVICE_MAP_STRATEGIES:
            raise DeviceError(f"device_map '{device_map}' is not one of {list(DEVICE_MAP_STRATEGIES)} nor a mapping "
                              "{module name: device}")
        return device_map
    if not isinstance(device_map, dict) or not device_map:
        raise DeviceError(f"device_map must be {list(DEVICE_MAP_STRATEGIES)} or a mapping {{module: device}}, "
                          f"got {device_map!r}")
    checked = {}
    for module, where in device_map.items():
        if where == "disk":
            checked[module] = where
            continue
        name = f"cuda:{where}" if isinstance(where, int) and not isinstance(where, bool) else str(where)
        try:
            checked[module] = str(resolve_device(name)) if name != "auto" else None
        except DeviceError:
            raise DeviceError(f"device_map puts '{module}' on '{where}', which is not on this machine; the "
                              f"devices here are {available_devices()} (and 'disk')") from None
        if checked[module] is None:
            raise DeviceError(f"device_map puts '{module}' on 'auto': name a device, one of {available_devices()}")
    return checked


def synchronize(device: torch.device | str) -> None:
    """Wait until the device has finished its queued work (CUDA, MPS); nothing to wait for on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """cuda and cuda:<current> are one device; cpu and cpu:0 too."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    current = torch.cuda.current_device()
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)


def total_memory(device) -> int:
    """All the memory of `device`: a GPU's total, or the machine's MemTotal."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
