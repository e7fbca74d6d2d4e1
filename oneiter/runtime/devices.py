"""The device table, and resolving a user's device string to a `torch.device`.

Everything oneiter does differently per device type reads `DEVICE_TYPES` (through `device_type`): the vendor
plugin to import and the pip package to name when it is missing (here, and in every op reproducer
`record/replay/op_repro.py` writes, which `format/op_case.py` reads without importing oneiter), the
torch.distributed backend (`distributed.py`), the profiler activity and the allocator's memory history
(`profile/run_parts.py`), the default autocast dtype (`integrations/mmengine.py`), and which torch flags make its
float32 matmuls and convolutions run in a reduced precision (`precision_modes.py`). A new device is one row here
(and, for a vendor whose reduced-precision flags oneiter does not know yet, their reading in `precision_modes.py`).

`npu` needs torch_npu (Ascend), `mlu` torch_mlu (Cambricon), `dipu` torch_dipu (DIPU/DIOPI chips); `cuda` and
`xpu` are built into torch builds that have them. Plugins are imported here and nowhere else, lazily, so a CPU
machine never imports them and a machine that has them needs no extra flag. A plugin oneiter has no row for (one
that renamed torch's PrivateUse1 backend, imported by the user's code first) gets the PrivateUse1 rule.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace

from oneiter.errors import DeviceError

__all__ = [
    "DeviceType", "DEVICE_TYPES", "PRIVATEUSE1", "PRIVATEUSE1_SINCE", "device_type", "profiler_activity",
    "memory_history_api", "resolve_device", "device_name", "plugins",
]


@dataclass(frozen=True)
class DeviceType:
    """What oneiter needs to know about one torch device type."""

    name: str
    plugin: str | None = None
    """Python module that registers the device type with torch, imported only when the device is asked for."""
    package: str | None = None
    """What to install when `plugin` is not importable (named in the error)."""
    backend: str | None = None
    """torch.distributed backend for multi-rank runs; None: multi-rank recording is refused on this type."""
    activity: str | None = None
    """Name of the `torch.profiler.ProfilerActivity` of the device's own work; None: the profiler sees the CPU only."""
    memory_history: bool = False
    """`torch.<name>.memory` has CUDA's `_record_memory_history` / `_dump_snapshot` (torch_npu and torch_mlu
    mirror it): the allocator history behind `--profile-memory`'s snapshot."""
    autocast_dtype: str = "float16"
    """The dtype autocast uses when a run asks for mixed precision without naming one (torch's own defaults)."""
    precision_flags: str | None = None
    """Which torch flags say its float32 matmuls and convolutions run reduced (`precision_modes.py` reads them):
    `cuda` (TF32: torch.backends.cuda and cudnn), `mkldnn` (oneDNN on the CPU), `npu` (torch_npu's HF32 switches);
    None: none known, float32 stays float32."""


DEVICE_TYPES: dict[str, DeviceType] = {t.name: t for t in (
    DeviceType("cpu", backend="gloo", autocast_dtype="bfloat16", precision_flags="mkldnn"),
    DeviceType("cuda", backend="nccl", activity="CUDA", memory_history=True, precision_flags="cuda"),
    DeviceType("npu", plugin="torch_npu", package="torch-npu", backend="hccl", activity="PrivateUse1",
               memory_history=True, precision_flags="npu"),
    DeviceType("mlu", plugin="torch_mlu", package="torch_mlu (Cambricon's PyTorch plugin)", backend="cncl",
               activity="PrivateUse1", memory_history=True),
    DeviceType("dipu", plugin="torch_dipu", package="torch_dipu (DeepLink's DIPU)", activity="PrivateUse1"),
    DeviceType("xpu", activity="XPU", memory_history=True),
)}  # fmt: skip

PRIVATEUSE1 = DeviceType("privateuseone", activity="PrivateUse1", memory_history=True)
"""The rule for a plugin device oneiter has no row for: torch's PrivateUse1 backend under the plugin's name."""

PRIVATEUSE1_SINCE = "2.3"
"""The first torch whose profiler has `ProfilerActivity.PrivateUse1`."""


def device_type(name: str) -> DeviceType:
    """The row of device type `name`: the table's, the PrivateUse1 rule when `name` is the type a plugin
    registered, else a row that knows nothing (no plugin, backend, activity or memory history)."""
    known = DEVICE_TYPES.get(name)
    if known is not None:
        return known
    if name == _privateuse1_name():
        return replace(PRIVATEUSE1, name=name)
    return DeviceType(name)


def _privateuse1_name() -> str:
    import torch

    return torch._C._get_privateuse1_backend_name()


def profiler_activity(name: str):
    """The `ProfilerActivity` of device type `name`'s own work, or None: the CPU, a type without one, or a torch
    whose profiler lacks it (`PrivateUse1` came with torch PRIVATEUSE1_SINCE); the caller says which."""
    activity = device_type(name).activity
    if activity is None:
        return None
    from torch.profiler import ProfilerActivity

    return getattr(ProfilerActivity, activity, None)


def memory_history_api(name: str):
    """`torch.<name>.memory` when it can record and dump the allocator's history, else None (the CPU, a type
    without it, or a plugin too old for it)."""
    if not device_type(name).memory_history:
        return None
    import torch

    memory = getattr(getattr(torch, name, None), "memory", None)
    wanted = ("_record_memory_history", "_dump_snapshot")
    return memory if all(callable(getattr(memory, f, None)) for f in wanted) else None


def plugins() -> dict[str, str]:
    """Device type -> the vendor plugin module that registers it, for the types that need one."""
    return {t.name: t.plugin for t in DEVICE_TYPES.values() if t.plugin}


def _import_plugin(dev_type: DeviceType) -> None:
    assert dev_type.plugin is not None  # asked only for a type with a plugin
    try:
        importlib.import_module(dev_type.plugin)
    except ImportError as exc:
        raise DeviceError(
            f"device '{dev_type.name}' needs the vendor plugin '{dev_type.plugin}', which is not importable ({exc}); "
            f"install {dev_type.package} on a machine with that device"
        ) from None


def resolve_device(spec: str):
    """Return a `torch.device` for `spec` ('cpu', 'cuda:1', 'npu', ...), or raise DeviceError in one line."""
    import torch

    spec = spec.strip()
    known = DEVICE_TYPES.get(spec.split(":", 1)[0])
    if known is not None and known.plugin is not None:
        _import_plugin(known)
    try:
        device = torch.device(spec)
    except RuntimeError as exc:
        raise DeviceError(f"unknown device '{spec}': {str(exc).splitlines()[0]}") from None
    if device.type == "cpu":
        return device
    backend = getattr(torch, device.type, None)
    is_available = getattr(backend, "is_available", None)
    if is_available is None or not is_available():
        raise DeviceError(
            f"device '{spec}' is not available on this machine (torch.{device.type}.is_available() is false)")
    count = getattr(backend, "device_count", lambda: 1)()
    if device.index is not None and device.index >= count:
        raise DeviceError(f"device '{spec}' does not exist: this machine has {count} {device.type} device(s)")
    return device


def device_name(device) -> str:
    """A human-readable name of the hardware behind `device` (CPU model, GPU/NPU product name)."""
    if device.type == "cpu":
        import platform

        return _cpu_model() or platform.processor() or platform.machine()
    import torch

    backend = getattr(torch, device.type, None)
    get_name = getattr(backend, "get_device_name", None)
    try:
        return str(get_name(device)) if get_name else device.type
    except Exception:  # a vendor plugin may not implement it for every index
        return device.type


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""
