"""Resolve a user's device string to a `torch.device`, importing vendor plugins only when asked for.

`npu` needs torch_npu (Ascend), `mlu` torch_mlu (Cambricon), `dipu` torch_dipu (DIPU/DIOPI chips); `cuda` and
`xpu` are built into torch builds that have them. Plugins are imported here and nowhere else, lazily, so a CPU
machine never imports them and a machine that has them needs no extra flag.
"""

from __future__ import annotations

import importlib

from oneiter.errors import DeviceError

__all__ = ["PLUGINS", "resolve_device", "device_name"]

# device type -> (python module that registers it, pip package to suggest)
PLUGINS: dict[str, tuple[str, str]] = {
    "npu": ("torch_npu", "torch-npu"),
    "mlu": ("torch_mlu", "torch_mlu (Cambricon's PyTorch plugin)"),
    "dipu": ("torch_dipu", "torch_dipu (DeepLink's DIPU)"),
}


def _import_plugin(dev_type: str) -> None:
    module, package = PLUGINS[dev_type]
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise DeviceError(
            f"device '{dev_type}' needs the vendor plugin '{module}', which is not importable ({exc}); "
            f"install {package} on a machine with that device"
        ) from None


def resolve_device(spec: str):
    """Return a `torch.device` for `spec` ('cpu', 'cuda:1', 'npu', ...), or raise DeviceError in one line."""
    import torch

    spec = spec.strip()
    dev_type = spec.split(":", 1)[0]
    if dev_type in PLUGINS:
        _import_plugin(dev_type)
    try:
        device = torch.device(spec)
    except RuntimeError as exc:
        raise DeviceError(f"unknown device '{spec}': {str(exc).splitlines()[0]}") from None
    if device.type == "cpu":
        return device
    backend = getattr(torch, device.type, None)
    is_available = getattr(backend, "is_available", None)
    if is_available is None or not is_available():
        raise DeviceError(f"device '{spec}' is not available on this machine (torch.{device.type}.is_available() is false)")
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
