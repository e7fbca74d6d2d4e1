"""Tolerance files: per-device precision settings in TOML or an mmengine config (`--tolerances FILE`).

Sits beside `tolerance.py` (dtype defaults, and the noise factor blame flags by): one file per device, in the spirit
of DIOPI's `device_configs.py` and ditorch's per-op tolerance variables, read once and turned into the two
policies the engine takes. Example `npu.toml`::

    device = "npu"              # optional: a warning if the target was recorded on another device type

    [noise]                     # blame: flag a layer whose local error > factor x expected noise
    factor = 4.0
    floor_ulps = 1.0

    [dtype.bfloat16]            # accumulated entries of this dtype
    atol = 1e-5
    rtol = 1.6e-2

    [[module]]                  # per-module-glob overrides, the last matching one wins
    pattern = "layer4.*"
    rtol = 1e-3
    factor = 8.0

    [skip]                      # never judged (still shown)
    modules = ["*.dropout"]

The same keys in an mmengine config (`npu.py`): `device = 'npu'`, `noise = dict(factor=4.0)`,
`dtype = dict(bfloat16=dict(atol=1e-5, rtol=1.6e-2))`, `module = [dict(pattern='layer4.*', rtol=1e-3)]`,
`skip = dict(modules=['*.dropout'])`. `--atol`/`--rtol` on the command line still override everything.
"""

from __future__ import annotations

import fnmatch
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from oneiter.errors import OneIterError
from oneiter.format.layout import Entry
from oneiter.judge.measure.tolerance import NoisePolicy, Tolerance, default_tolerance
from oneiter.runtime.precision import UNIT_ROUNDOFF

__all__ = ["ToleranceFile", "load_tolerance_file", "FileTolerance"]

_TOP_KEYS = {"device", "noise", "dtype", "module", "skip"}


@dataclass
class ToleranceFile:
    """The parsed file: what `FileTolerance` and `NoisePolicy` are built from."""

    path: Path
    device: Optional[str] = None
    dtypes: dict[str, dict[str, float]] = field(default_factory=dict)
    modules: list[dict[str, Any]] = field(default_factory=list)
    skip: list[str] = field(default_factory=list)
    noise: NoisePolicy = field(default_factory=NoisePolicy)

    def device_mismatch(self, device: Optional[str]) -> Optional[str]:
        """A one-line warning when the file names a device type and the target ran on another (`npu:1` -> `npu`)."""
        device_type = (device or "").split(":", 1)[0]
        if self.device and device_type and self.device != device_type:
            return f"{self.path.name} is for device '{self.device}', the target ran on '{device_type}'"
        return None


class FileTolerance:
    """Tolerance policy: dtype defaults < [dtype.X] < matching [[module]] < --atol/--rtol; skipped modules pass."""

    def __init__(self, spec: ToleranceFile, *, atol: Optional[float] = None, rtol: Optional[float] = None):
        self.spec, self.atol, self.rtol = spec, atol, rtol

    def __call__(self, entry: Entry, dtype: str) -> Tolerance:
        if any(fnmatch.fnmatchcase(entry.module, p) for p in self.spec.skip):
            return Tolerance(math.inf, 0.0, f"skipped by {self.spec.path.name}")
        base = default_tolerance(dtype)
        atol, rtol, source = base.atol, base.rtol, base.source
        if dtype in self.spec.dtypes:
            atol = self.spec.dtypes[dtype].get("atol", atol)
            rtol = self.spec.dtypes[dtype].get("rtol", rtol)
            source = f"{self.spec.path.name} [dtype.{dtype}]"
        for override in self.spec.modules:
            if fnmatch.fnmatchcase(entry.module, override["pattern"]):
                atol, rtol = override.get("atol", atol), override.get("rtol", rtol)
                source = f"{self.spec.path.name} module {override['pattern']}"
        if self.atol is not None or self.rtol is not None:
            atol = atol if self.atol is None else self.atol
            rtol = rtol if self.rtol is None else self.rtol
            source = "--atol/--rtol"
        return Tolerance(atol, rtol, source)


def _read(path: Path) -> dict[str, Any]:
    if path.suffix == ".toml":
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # Python 3.10: the same parser, as a package
            import tomli as tomllib

        try:
            return tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            raise OneIterError(f"--tolerances {path}: not valid TOML ({exc})") from None
    if path.suffix == ".py":
        from mmengine.config import Config

        try:
            return Config.fromfile(str(path)).to_dict()
        except Exception as exc:  # mmengine raises many types for a broken config
            raise OneIterError(f"--tolerances {path}: cannot load the mmengine config ({exc})") from None
    raise OneIterError(f"--tolerances expects a .toml file or an mmengine .py config, got '{path}'")


def _number(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise OneIterError(f"{where} should be a number >= 0, but got {value!r}")
    return float(value)


def _toml_table(where: str, value: Any, keys: tuple[str, ...] | None = None) -> dict:
    """`value` as a table (dict), with only `keys` in it (when given): a misspelled key is an error, not ignored."""
    if not isinstance(value, dict):
        raise OneIterError(f"{where}: expected a table, got {type(value).__name__} {value!r}")
    unknown = [] if keys is None else sorted(str(k) for k in value if k not in keys)
    if keys is not None and unknown:
        raise OneIterError(f"{where}: unknown key(s) {', '.join(unknown)}; expected {', '.join(keys)}")
    return value


def load_tolerance_file(path: str | Path) -> ToleranceFile:
    """Parse and validate a tolerance file; every error names the key and the file."""
    path = Path(path)
    if not path.is_file():
        raise OneIterError(f"--tolerances: '{path}' does not exist")
    data = {k: v for k, v in _read(path).items() if not k.startswith("_")}
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise OneIterError(f"{path.name}: unknown key(s) {', '.join(unknown)}; expected {', '.join(sorted(_TOP_KEYS))}")
    name = path.name
    device = data.get("device")
    if device is not None and not isinstance(device, str):
        raise OneIterError(f"{name} device: expected a device type such as \"npu\", got {device!r}")
    spec = ToleranceFile(path, device=device)
    for dtype, values in _toml_table(f"{name} dtype", data.get("dtype") or {}).items():
        if dtype not in UNIT_ROUNDOFF:
            raise OneIterError(f"{name}: unknown dtype '{dtype}'; expected one of {', '.join(UNIT_ROUNDOFF)}")
        values = _toml_table(f"{name} dtype.{dtype}", values, ("atol", "rtol"))
        spec.dtypes[dtype] = {k: _number(f"{name} dtype.{dtype}.{k}", v) for k, v in values.items()}
    modules = data.get("module") or []
    if not isinstance(modules, list):
        raise OneIterError(f"{name} module: expected a list of tables ([[module]]), got {type(modules).__name__}")
    for i, override in enumerate(modules):
        override = _toml_table(f"{name} module entry {i}", override, ("pattern", "atol", "rtol", "factor"))
        if not isinstance(override.get("pattern"), str):
            raise OneIterError(f"{name}: module entry {i} should have a 'pattern' string, but got {override}")
        clean = {"pattern": override["pattern"]}
        clean.update({k: _number(f"{name} module {i} {k}", v) for k, v in override.items() if k != "pattern"})
        spec.modules.append(clean)
    skip = _toml_table(f"{name} skip", data.get("skip") or {}, ("modules",)).get("modules", [])
    if not isinstance(skip, list) or not all(isinstance(p, str) for p in skip):
        raise OneIterError(f"{name} skip.modules: expected a list of module globs, got {skip!r}")
    spec.skip = list(skip)
    noise = _toml_table(f"{name} noise", data.get("noise") or {}, ("factor", "floor_ulps"))
    spec.noise = NoisePolicy(
        factor=_number(f"{path.name} noise.factor", noise.get("factor", 4.0)),
        floor_ulps=_number(f"{path.name} noise.floor_ulps", noise.get("floor_ulps", 1.0)),
        overrides=[(m["pattern"], m["factor"]) for m in spec.modules if "factor" in m],
        skip=list(spec.skip),
    )
    return spec
