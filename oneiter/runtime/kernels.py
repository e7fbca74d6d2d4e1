"""Which kernels a device type runs that are not torch's own, asked of the dispatcher.

Where this sits: a calibration (`record/local/probe.py`, `record/replay/op_rerun.py`) measures the noise of a
precision by rerunning module calls or ops on the CPU in float32 and float64, and trusts the kernels it runs there.
A plugin can replace any of them: `torch.library.Library("aten", "IMPL").impl("silu", fn, "CPU")` (or the
decorators `torch.library.impl` / `register_kernel`) puts a Python kernel over torch's CPU kernel; a C++ extension
(`TORCH_LIBRARY_IMPL(aten, CPU, m)`) a compiled one; a PrivateUse1 backend (Ascend's torch_npu, and every other
out-of-tree device) brings a kernel of its own for every op it runs. A wrong kernel the calibration runs makes its
own error look like noise, so before calibrating the probes ask `foreign(device_type)` which ops those are;
`record/modes/trusted.py` then runs them another way.

**How the dispatcher says it.** `torch._C._dispatch_dump_table(op)` prints, for each runtime dispatch key, the kernel
a call would run and where it was registered (`CPU: registered at /path/file.cpp:123 [kernel]`). torch's own C++
kernels were registered from torch's source tree (the folder aten's own schemas were registered from: its
`RegisterSchema.cpp`), torch's own Python kernels (prims) from files inside the installed `torch` package. Anything
else is not torch's own: a registration from another file, and every Python kernel registered through
`torch.library`'s helpers (whose registrations name those helpers in torch's package, not the caller). Keys
looked at, for a device type: its backend key (`CPU`, `CUDA`, `PrivateUse1`...) and its autograd key
(`AutogradCPU`...: a replaced backward formula).

**Which ops are asked.** Every op with a kernel registered directly for those keys (about 1,200 for the CPU), and
every op `torch.library` holds a Python registration of (`torch.library._impls`, for the alias keys:
`CompositeImplicitAutograd`, `Autograd` too); each is asked the kernel a call would run
(`_dispatch_get_computed_kernel_for_dispatch_key`), about 0.1 s in all. The answer is kept while the Python
registrations are the same and no module was imported (a C++ extension registers its kernels when imported). A C++
kernel an extension registers only for an alias key is not seen.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Mapping

__all__ = ["Foreign", "foreign", "backend_keys", "is_plugin_backend", "op_named", "own_registration",
           "registered_at", "alias_registered_at"]

# `SafeKernelFunction(debug='registered at /path/file.cpp:123')`: the computed kernel of an op for a runtime key
_DEBUG = re.compile(r"registered at (?P<where>.*?)'\)?$")
_SCHEMA_LINE = re.compile(r"^debug: registered at (?P<where>.*)$", re.M)
_HELPERS = ("library.py", "_library" + os.sep)  # inside the torch package: registration helpers, not kernels


@dataclass(frozen=True)
class Foreign:
    """An op whose kernel for a runtime key is not torch's own."""

    op: str
    """The dispatcher's name: `aten::silu`, `aten::silu_backward.grad_input`."""
    key: str
    """The runtime key: `CPU`, `AutogradCPU`, `CUDA`, `PrivateUse1`..."""
    registered: str
    """Where the dispatcher says the kernel was registered (`file:line`)."""

    @property
    def autograd(self) -> bool:
        """A replaced backward formula (an autograd key): no dispatch mode below autograd can step around it."""
        return self.key.startswith("Autograd")

    def describe(self) -> str:
        return f"{self.op} ({self.key} kernel registered at {_short(self.registered)})"


def backend_keys(device_type: str) -> tuple[str, str]:
    """(backend key, autograd key) of a device type: `cpu` -> (CPU, AutogradCPU); an out-of-tree device (npu, mlu,
    dipu: torch's PrivateUse1 backend under another name) -> (PrivateUse1, AutogradPrivateUse1)."""
    import torch

    try:
        key = torch._C._dispatch_key_for_device(device_type)
    except RuntimeError:
        key = "PrivateUse1"
    if key == "PrivateUse1" or device_type == torch._C._get_privateuse1_backend_name():
        key = "PrivateUse1"
    return key, f"Autograd{key}"


def is_plugin_backend(device_type: str) -> bool:
    """Whether every kernel of the device type is a plugin's (a PrivateUse1 backend: torch has none of its own)."""
    return backend_keys(device_type)[0] == "PrivateUse1"


def foreign(device_type: str = "cpu") -> tuple[Foreign, ...]:
    """The ops whose kernels on `device_type` are not torch's own (module docstring), by op name. For a PrivateUse1
    device only the ops torch registered no kernel of its own for are skipped: its backend kernels are all listed."""
    import torch

    keys = backend_keys(device_type)
    python = frozenset(getattr(torch.library, "_impls", ()) or ())
    return _census(keys, python, len(sys.modules))


@lru_cache(maxsize=8)
def _census(keys: tuple[str, str], python: frozenset, modules: int) -> tuple[Foreign, ...]:
    """The census, kept while the Python registrations are the same and no module was imported: the ops of the
    last full scan whose kernels were not torch's (`_scan`) and the ops `torch.library` holds Python registrations
    of (torch's own included), each asked again where its registrations changed (`_asked`)."""
    by_op: dict[str, set[str]] = {}
    for entry in python:  # `aten/silu/CPU`, `aten/silu.out/CompositeImplicitAutograd`
        namespace, _, rest = entry.partition("/")
        op, _, key = rest.rpartition("/")
        if namespace and op:
            by_op.setdefault(f"{namespace}::{op}", set()).add(key)
    names = set(_scan(keys, modules)) | set(by_op)
    return tuple(f for name in sorted(names) for f in _asked(name, keys, frozenset(by_op.get(name, ())), modules))


@lru_cache(maxsize=4096)
def _asked(name: str, keys: tuple[str, str], python_keys: frozenset, modules: int) -> tuple[Foreign, ...]:
    """The kernels of one op for `keys` that are not torch's own; asked again only when its Python registrations
    (`python_keys`) or the imported modules changed."""
    return _not_own(name, keys)


def _not_own(name: str, keys: tuple[str, str]) -> tuple[Foreign, ...]:
    found = []
    for key in keys:
        where = registered_at(name, key)
        if where is not None and not own_registration(where, name):
            found.append(Foreign(name, key, where))
    return tuple(found)


@lru_cache(maxsize=4)
def _scan(keys: tuple[str, str], modules: int) -> tuple[str, ...]:
    """Every op with a kernel registered directly for `keys` whose kernel is not torch's own (the slow part, about
    0.1 s: redone only when a module was imported, as a C++ extension registers its kernels on import)."""
    import torch

    names = set()
    for key in keys:
        names.update(torch._C._dispatch_get_registrations_for_dispatch_key(key))
    return tuple(sorted({f.op for name in sorted(names) for f in _not_own(name, keys)}))


def registered_at(name: str, key: str) -> str | None:
    """Where the kernel a call of `name` runs for runtime key `key` was registered (None: no kernel)."""
    import torch

    try:
        kernel = torch._C._dispatch_get_computed_kernel_for_dispatch_key(name, getattr(torch._C.DispatchKey, key))
    except (RuntimeError, AttributeError):
        return None
    match = _DEBUG.search(str(kernel))
    return match["where"] if match else None


def own_registration(where: str, op: str = "") -> bool:
    """Whether a kernel registered at `where` (`file:line`, as the dispatcher prints it) is torch's own."""
    path = where.rsplit(":", 1)[0] if re.search(r":\d+$", where) else where
    root = _torch_source_root()
    if root and path.startswith(root):
        return True
    package = _torch_package()
    if path.startswith(package):
        if path[len(package):].startswith(_HELPERS):  # registered through a helper: whose kernel it is is unknown
            return _torch_custom_op(op)
        return True
    return not root and ("/aten/src/ATen/" in path or "/torch/csrc/" in path)


def alias_registered_at(name: str, key: str) -> str | None:
    """Where the kernel of `name` for an alias key (`CompositeExplicitAutograd`...) was registered (None: none)."""
    import torch

    if not torch._C._dispatch_has_kernel_for_dispatch_key(name, key):
        return None
    match = re.search(rf"^{key}\[alias\]: registered at (?P<where>.*?) ::", torch._C._dispatch_dump(name), re.M)
    return match["where"] if match else None


@lru_cache(maxsize=1)
def _torch_source_root() -> str:
    """The folder torch was built from, as its registrations name it (`/__w/pytorch/pytorch/`); "" if unknown."""
    import torch

    match = _SCHEMA_LINE.search(torch._C._dispatch_dump("aten::add.Tensor"))
    where = match["where"] if match else ""
    for marker in ("/build/aten/src/", "/aten/src/", "/torch/csrc/"):
        if marker in where:
            return where[: where.index(marker) + 1]
    return ""


def _torch_custom_op(op: str) -> bool:
    """Whether a kernel registered through torch.library's helpers for `op` is torch's own: an op of torch's outside
    aten (aten's kernels torch registers in C++ only) whose schema torch defined (`_c10d_functional`, `_dtensor`), or
    one of torch's custom ops (prims, onnx: `torch.library.custom_op` in a module of torch) with no kernel registered
    over the one it was defined with."""
    import torch

    if op.startswith("aten::"):
        return False
    opdefs: Mapping[str, Any]
    try:
        from torch._library.custom_ops import OPDEFS as opdefs
    except ImportError:
        opdefs = {}
    opdef = opdefs.get(op) or opdefs.get(op.partition(".")[0])
    if opdef is not None:
        init = getattr(opdef, "_init_fn", None)
        backends = getattr(opdef, "_backend_fns", {}) or {}
        return bool(init is not None and str(getattr(init, "__module__", "")).startswith("torch.")
                    and set(backends) <= {None})
    try:
        match = _SCHEMA_LINE.search(torch._C._dispatch_dump(op))
    except RuntimeError:
        return False
    schema = match["where"] if match else ""
    return own_registration(schema) and not _through_helper(schema)


def _through_helper(where: str) -> bool:
    package = _torch_package()
    return where.startswith(package) and where[len(package):].startswith(_HELPERS)


@lru_cache(maxsize=1)
def _torch_package() -> str:
    import torch

    return os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def op_named(name: str):
    """The OpOverload of a dispatcher name (`aten::silu` -> torch.ops.aten.silu.default), or None."""
    import torch

    namespace, _, rest = name.partition("::")
    packet_name, _, overload = rest.partition(".")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), packet_name), overload or "default")
    except (AttributeError, RuntimeError):
        return None


def _short(where: str) -> str:
    """A registration's place as a reader wants it: relative to the working folder when under it."""
    try:
        relative = os.path.relpath(where)
    except ValueError:
        return where
    return where if relative.startswith("..") else relative
