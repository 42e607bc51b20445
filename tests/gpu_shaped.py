"""What a GPU gives the code, on a CPU: two devices that refuse each other's tensors, a CUDA module that
answers like one with two cards, and a count of the host's waits on the device.

`TwoDevices` is a torch function mode.  Every tensor keeps its real CPU data (so a whole decode runs
and its tokens can be compared), but carries a *virtual* device, kept on its storage: `cpu`, `cuda:0` or
`cuda:1`.  `x.device` answers the virtual device, `.to("cuda:1")` (and `device=` on a factory) moves a
tensor there, an op's result lands on its inputs' device, and an op that mixes two devices raises as
CUDA does:

- a 0-dim CPU tensor may join a CUDA op (as a Python scalar does);
- an index tensor must be on the CPU or on the indexed tensor's device;
- `copy_` (and so `x[i] = y` through a slice) copies across devices, as CUDA allows.

While it is active, `torch.cuda` says two devices are there (is_available, device_count, synchronize,
the RNG state of each device): enough for the device decisions in draftsmith; no kernel runs anywhere
but on the CPU.  `torch.Generator("cuda:0")` gives a generator of that device (a CPU generator that says
cuda:0), and a random draw refuses a generator of another device type than the tensor it makes, as CUDA
does ("Expected a 'cuda' device type for generator but found 'cpu'").  `host_waits` counts each `.item()`, `.tolist()`, `bool()`, `nonzero` and boolean
mask indexing of a tensor on a CUDA device: the points where a real host would wait on the GPU.

Real CUDA refuses more than this mode does (streams, pinned memory, kernels per dtype): docs/gpu.md says
what only a real GPU shows.
"""
from __future__ import annotations

import contextlib
import os
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

CPU = torch.device("cpu")
MOVES = {"to", "cuda", "cpu", "_to_copy"}
CROSS_DEVICE_OK = {"copy_", "set_", "_has_compatible_shallow_copy_type", "is_same_size"}   # and every setter
INDEXING = {"__getitem__", "__setitem__", "index_select", "index", "gather", "scatter", "scatter_", "index_put_",
            "index_put", "index_copy_", "index_add_", "take_along_dim", "scatter_add_", "index_fill_"}
SYNCS = {"item", "tolist", "__bool__", "nonzero", "numpy", "__int__", "__float__", "__index__", "argwhere",
         "unique", "masked_select"}
IN_PLACE_OPERATORS = {f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or",
                                                 "xor", "lshift", "rshift", "matmul")}


def _name(func) -> str:
    owner = getattr(func, "__self__", None)
    if owner is not None and type(owner).__name__ == "getset_descriptor":
        return owner.__name__ + "." + func.__name__           # 'device.__get__', 'data.__set__'
    return getattr(func, "__name__", "")


class CrossDeviceError(RuntimeError):
    """An op that would mix tensors of two devices, as CUDA refuses it."""


REAL_GENERATOR = torch.Generator


class VirtualGenerator(REAL_GENERATOR):
    """torch.Generator(device) inside the mode: a CPU generator that says which device it is for."""

    def __new__(cls, device="cpu"):
        return super().__new__(cls, "cpu")

    def __init__(self, device="cpu"):
        super().__init__()
        device = torch.device(device)
        self.virtual_device = torch.device("cuda", device.index or 0) if device.type == "cuda" else CPU

    @property
    def device(self) -> torch.device:
        return self.virtual_device


class TwoDevices(TorchFunctionMode):
    """A torch function mode in which tensors live on virtual devices (see the module docstring)."""

    def __init__(self, device_count: int = 2):
        super().__init__()
        self.device_count = device_count
        self.host_waits: list[str] = []            # a name per wait of the host on a CUDA device
        self._patches = contextlib.ExitStack()

    # -- virtual devices -------------------------------------------------------
    def device_of(self, t: torch.Tensor) -> torch.device:
        try:
            return getattr(t.untyped_storage(), "_virtual_device", CPU)
        except (RuntimeError, NotImplementedError):
            return CPU

    def place(self, t, device: torch.device):
        """Put `t` (its storage, so its views and a parameter whose .data it becomes) on a virtual device."""
        if isinstance(t, torch.Tensor):
            try:
                t.untyped_storage()._virtual_device = device
            except (RuntimeError, NotImplementedError):
                pass
        return t

    @staticmethod
    def _device(value) -> torch.device:
        device = torch.device(value)
        return torch.device("cuda", 0) if device.type == "cuda" and device.index is None else device

    # -- torch.cuda, answered as a machine with `device_count` GPUs ----------------------------------
    def __enter__(self):
        cuda = torch.cuda
        states = {i: torch.get_rng_state() for i in range(self.device_count)}
        fake = {
            "is_available": lambda: True, "device_count": lambda: self.device_count,
            "current_device": lambda: 0, "synchronize": lambda device=None: None,
            "is_bf16_supported": lambda *a, **k: True, "empty_cache": lambda: None,
            "get_rng_state": lambda device="cuda": states[self._index(device)].clone(),
            "set_rng_state": lambda state, device="cuda": states.__setitem__(self._index(device), state.clone()),
            "get_rng_state_all": lambda: [states[i].clone() for i in range(self.device_count)],
            "set_rng_state_all": lambda all_states: [states.__setitem__(i, s.clone()) for i, s in enumerate(all_states)],
            "manual_seed_all": lambda seed: None, "manual_seed": lambda seed: None,
            "mem_get_info": lambda device=None: (70 << 30, 80 << 30),
            "get_device_name": lambda device=None: "virtual GPU (tests/gpu_shaped.py)",
            "get_device_capability": lambda device=None: (9, 0),
        }
        for name, value in fake.items():
            self._patches.enter_context(mock.patch.object(cuda, name, value))
        self._patches.enter_context(mock.patch.object(torch, "Generator", VirtualGenerator))
        # transformers materialises weights in worker threads, where a torch function mode is not active
        self._patches.enter_context(mock.patch.dict(os.environ, {"HF_DEACTIVATE_ASYNC_LOAD": "1"}))
        self.rng_states = states
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._patches.close()

    def _index(self, device) -> int:
        if isinstance(device, int):
            return device
        device = torch.device(device)
        return device.index or 0

    # -- every torch call ----------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = _name(func)
        if func is torch.device and args and isinstance(args[0], int):
            return torch.device("cuda", args[0])         # torch.device(1): the accelerator's device 1
        if name == "device.__get__":
            return self.device_of(args[0])
        if name == "is_cuda.__get__":
            return self.device_of(args[0]).type == "cuda"
        if name == "is_cpu.__get__":
            return self.device_of(args[0]).type == "cpu"
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        if name in SYNCS and tensors and self.device_of(tensors[0]).type == "cuda":
            self.host_waits.append(name)
        target = None
        if "device" in kwargs and kwargs["device"] is not None:
            target = self._device(kwargs["device"])
            kwargs["device"] = CPU
        if name in MOVES:
            return self._move(name, args, kwargs, target)
        generator = kwargs.get("generator")
        if generator is not None:
            drawn_on = target or next((d for d in map(self.device_of, tensors) if d.type != "cpu"), CPU)
            made_for = getattr(generator, "virtual_device", CPU)
            if made_for.type != drawn_on.type:
                raise CrossDeviceError(f"{name}: Expected a '{drawn_on.type}' device type for generator but found "
                                       f"'{made_for.type}' (CUDA refuses a generator of another device)")
        if name not in CROSS_DEVICE_OK and not name.endswith(".__set__"):
            self._check(name, args, tensors)
        if name == "__getitem__" and len(args) > 1 and self.device_of(args[0]).type == "cuda":
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index):
                self.host_waits.append("boolean index")
        if func is torch.histc and not args[0].is_floating_point():
            args = (args[0].float(), *args[1:])     # CUDA's histc counts integers; the CPU's kernel does not
        out = func(*args, **kwargs)
        in_place = (name.endswith("_") and not name.endswith("__")) or name in IN_PLACE_OPERATORS
        if in_place or name.endswith(".__set__") or out is None:
            return out                                  # in place: the tensor stays where it is
        if target is None:       # a new tensor lands where its inputs are
            target = next((d for d in map(self.device_of, tensors) if d.type != "cpu"), CPU)
        tree_map(lambda o: self.place(o, target) if isinstance(o, torch.Tensor) else o, out)
        return out

    def _move(self, name, args, kwargs, target):
        """`.to(...)`, `.cuda()`, `.cpu()`: a real copy whenever the virtual device changes, so the tensor
        moved from stays where it was."""
        source, rest = args[0], []
        if name == "cpu":
            target = CPU
        elif name == "cuda":
            target = self._device(args[1] if len(args) > 1 else kwargs.pop("device", "cuda"))
            kwargs = {k: v for k, v in kwargs.items() if k == "non_blocking"}
        else:
            for value in args[1:]:
                if isinstance(value, (str, torch.device)):
                    target = self._device(value)
                elif isinstance(value, torch.Tensor):
                    target = self.device_of(value)
                    rest.append(value.dtype)
                else:
                    rest.append(value)
            kwargs.pop("device", None)
        target = self.device_of(source) if target is None else target
        changed = target != self.device_of(source)
        if changed:
            kwargs["copy"] = True
        out = torch.Tensor.to(source, CPU, *rest, **kwargs)
        if out is not source or changed:
            self.place(out, target)
        return out

    def _check(self, name, args, tensors):
        if not tensors:
            return
        if name == "__setitem__":
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if not any(isinstance(i, torch.Tensor) for i in index):
                return                                    # a slice assignment is a copy_: any device may write
        if name in INDEXING and len(tensors) >= 2:
            base = self.device_of(tensors[0])
            for index in tensors[1:]:
                where = self.device_of(index)
                is_index = index.dtype in (torch.long, torch.int, torch.bool)
                if is_index and where.type == "cpu":
                    continue
                if where != base and not (index.dim() == 0 and where.type == "cpu"):
                    raise CrossDeviceError(
                        f"{name}: indices or values on {where} for a tensor on {base} (CUDA refuses this)")
            return
        devices = {self.device_of(t) for t in tensors if t.dim() > 0 or self.device_of(t).type != "cpu"}
        if len(devices) > 1:
            raise CrossDeviceError(f"Expected all tensors to be on the same device, but found at least two devices, "
                                   f"{' and '.join(sorted(map(str, devices)))}! (in {name})")
