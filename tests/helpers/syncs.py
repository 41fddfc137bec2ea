"""Where a CPU run would make a GPU run's host wait for the device: :class:`DeviceWaits`.

On CUDA, reading a device tensor's values on the host (``.item()``, ``int(t)``, ``.tolist()``,
``.cpu()``, ``if t:``), an operation whose output size depends on device values (``nonzero``, a
boolean-mask selection, ``unique``, ``repeat_interleave`` without ``output_size``) and a copy of
host data to the device from pageable memory (``torch.tensor(data, device=...)``) all wait for
the queued kernels. On CPU none of them waits, but the same calls are made, so counting them in
a CPU run of the same code counts the synchronisations of the GPU run.

Which tensors would be on the device: the model's parameters and buffers, every tensor the
runtime put there through :mod:`harts.kernels.host` (uploads and program buffers, which carry
host copies), every tensor made with a ``torch.device`` argument (the model's device), and
everything computed from those or written with their values (followed through every aten
operation, backward included). Host-to-device copies are the data-copying calls (``torch.tensor``,
``torch.as_tensor``, ``Tensor.to`` / ``new_tensor``) given a ``torch.device`` object as
destination (the code passes the model's device that way; host destinations are spelled
``"cpu"``), outside :mod:`harts.kernels.host`, whose uploads come from pinned memory on a GPU.
The reference kernels (``naive.py``) are left out: a GPU pass runs the fast kernels instead.
"""

from __future__ import annotations

import traceback
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

from harts.kernels import host

#: aten operations that, on a device tensor, read values on the host or size their output by them
_WAITING_OPS = {
    "aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default", "aten._unique2.default",
    "aten.unique_dim.default", "aten.unique_consecutive.default", "aten.equal.default", "aten.is_nonzero.default",
}
#: Tensor methods that hand a device tensor's values to the host
_READING_METHODS = {"tolist", "numpy", "cpu", "item", "__bool__", "__int__", "__float__", "__index__"}
_COPYING_FUNCTIONS = {"tensor", "as_tensor", "new_tensor", "to"}
#: calls not counted: from the reference kernels (not run by a GPU pass) and from the sanctioned upload
_SKIPPED_FILES = ("naive.py", "/kernels/host.py")


def _site() -> str | None:
    """The innermost frame of our code that made the call, None when the call comes from a skipped file."""
    frames = [f for f in traceback.extract_stack() if "/torch/" not in f.filename and not f.filename.endswith(__file__)]
    for frame in reversed(frames):
        if frame.filename.endswith(_SKIPPED_FILES):
            return None
        if "/harts/" in frame.filename or "/kernels/" in frame.filename or "/benchmarks/" in frame.filename:
            return f"{frame.filename.rsplit('/', 2)[-2]}/{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} {frame.line}"
    return "?"


class DeviceWaits:
    """Inside ``with DeviceWaits(model) as waits``: every call that would make the host wait for the device
    on CUDA, counted by source line in ``waits.sites``."""

    def __init__(self, *modules: torch.nn.Module) -> None:
        self.sites: Counter = Counter()
        self._device = WeakTensorKeyDictionary()
        for module in modules:
            for tensor in (*module.parameters(), *module.buffers()):
                self._device[tensor] = True

    def on_device(self, tensor) -> bool:
        return isinstance(tensor, torch.Tensor) and (
            tensor in self._device or host.host_values(tensor) is not None or host.value_range(tensor) is not None
            or (tensor._base is not None and tensor._base in self._device))

    def _record(self, what: str) -> None:
        site = _site()
        if site is not None:
            self.sites[f"{what} at {site}"] += 1

    def __enter__(self) -> "DeviceWaits":
        self._modes = (_Functions(self), _Operations(self))
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


class _Operations(TorchDispatchMode):
    def __init__(self, waits: DeviceWaits) -> None:
        super().__init__()
        self.waits = waits

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_device = any(self.waits.on_device(t) for t in inputs)
        name = str(func)
        if on_device:
            if name in _WAITING_OPS:
                self.waits._record(name)
            elif name == "aten.repeat_interleave.Tensor" and kwargs.get("output_size") is None:
                self.waits._record(name + " without output_size")
            elif name == "aten.index.Tensor" and any(i is not None and i.dtype == torch.bool for i in args[1]):
                self.waits._record("boolean-mask index")
        out = func(*args, **kwargs)
        if on_device:
            written = [value for argument, value in zip(func._schema.arguments, args)
                       if argument.alias_info is not None and argument.alias_info.is_write]
            for tensor in tree_leaves((out, written)):
                if isinstance(tensor, torch.Tensor):  # an in-place write of device values puts its target there
                    self.waits._device[tensor] = True
                    if tensor._base is not None:
                        self.waits._device[tensor._base] = True
        return out


class _Functions(TorchFunctionMode):
    def __init__(self, waits: DeviceWaits) -> None:
        super().__init__()
        self.waits = waits

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _READING_METHODS and args and self.waits.on_device(args[0]):
            self.waits._record(f"Tensor.{name}")
        elif name == "to" and args and self.waits.on_device(args[0]) and "cpu" in (*args[1:], kwargs.get("device")):
            self.waits._record("device-to-host copy (Tensor.to)")
        elif name in _COPYING_FUNCTIONS:
            destinations = [a for a in (*args[1:], *kwargs.values()) if isinstance(a, torch.device)]
            source = args[0] if args else kwargs.get("data")
            if destinations and not self.waits.on_device(source) and not kwargs.get("non_blocking"):
                self.waits._record(f"host-to-device copy ({name})")
        out = func(*args, **kwargs)
        if any(isinstance(a, torch.device) for a in (*args, *kwargs.values())):
            for tensor in tree_leaves(out):  # made for the model's device (torch.zeros(..., device=device), ...)
                if isinstance(tensor, torch.Tensor):
                    self.waits._device[tensor] = True
        return out
