"""The device table (`runtime/devices.py`): resolving device strings, and that the distributed backend, the
profiler's activities and memory history and the autocast default all come from the table.

A plugin device is a stand-in `torch_npu` (as in tests/cli/test_loop.py): it renames torch's PrivateUse1 backend,
which a process can do once, so those checks run in a child process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from dataclasses import replace

import pytest
import torch
from torch.profiler import ProfilerActivity

from oneiter.errors import DeviceError, OneIterError
from oneiter.profile.run_parts import activities, summary_head
from oneiter.profile.runner import ProfileOptions
from oneiter.profile.schedule import parse_schedule
from oneiter.runtime import devices
from oneiter.runtime.devices import DEVICE_TYPES, device_type, memory_history_api, profiler_activity, resolve_device
from oneiter.runtime.distributed import backend_for

# A stand-in plugin like the real ones: renames PrivateUse1 to its device type and registers `torch.<type>`
# (two devices, and the allocator-history API torch_npu mirrors from torch.cuda.memory).
PLUGIN = """\
import types, torch
torch.utils.rename_privateuse1_backend({name!r})
mod = types.ModuleType('torch.{name}')
mod.is_available = lambda: True
mod.device_count = lambda: 2
mod.memory = types.SimpleNamespace(_record_memory_history=lambda *a, **k: None, _dump_snapshot=lambda path: None)
torch._register_device_module({name!r}, mod)
"""

# What the child reports about the plugin device, every value read through oneiter's public functions (the
# renamed PrivateUse1 activity calls itself NPU then: it is reported by identity).
PROBE = """\
import json, sys, torch
from torch.profiler import ProfilerActivity as A
from oneiter.errors import OneIterError
from oneiter.profile.runner import ProfileOptions
from oneiter.profile.schedule import parse_schedule
from oneiter.profile.run_parts import activities, summary_head
from oneiter.runtime.devices import device_type, memory_history_api, resolve_device
from oneiter.runtime.distributed import backend_for
name = sys.argv[1]
if name not in ('npu',):  # a plugin without a row in the table: the user's code imported it first
    __import__('torch_' + name)
device = resolve_device(name + ':1')
try:
    resolve_device(name + ':2')
    missing = None
except OneIterError as err:
    missing = str(err)
try:
    backend = backend_for(name)
except OneIterError as err:
    backend = 'refused: ' + str(err)
head = summary_head(ProfileOptions(model='m', device=name), parse_schedule('active=1'), device)
print(json.dumps({
    'device': str(device), 'plain': str(resolve_device(name)), 'missing': missing, 'backend': backend,
    'activities': [{A.CPU: 'CPU', A.PrivateUse1: 'PrivateUse1'}.get(a, a.name) for a in activities(device)],
    'autocast': device_type(name).autocast_dtype,
    'memory_history': memory_history_api(name) is getattr(torch, name).memory,
    'notes': head['notes'], 'warnings': head['warnings'],
}))
"""


def probe_plugin(tmp_path, name: str) -> dict:
    (tmp_path / f"torch_{name}.py").write_text(PLUGIN.format(name=name))
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    res = subprocess.run([sys.executable, str(script), name], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_cpu_resolves_without_importing_any_plugin():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(" cpu ") == torch.device("cpu")
    assert resolve_device("cpu:0") == torch.device("cpu", 0)
    assert not any(row.plugin in sys.modules for row in DEVICE_TYPES.values() if row.plugin)


def test_unknown_device_name_is_one_line():
    with pytest.raises(DeviceError, match="^unknown device 'tpu9': ") as err:
        resolve_device("tpu9")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", [n for n, row in DEVICE_TYPES.items() if row.plugin])
def test_missing_plugin_names_its_pip_package_in_one_line(name):
    row = DEVICE_TYPES[name]
    if importlib.util.find_spec(row.plugin) is not None:
        pytest.skip(f"{row.plugin} is installed here")
    with pytest.raises(DeviceError) as err:
        resolve_device(f"{name}:0")
    message = str(err.value)
    assert "\n" not in message and f"'{row.plugin}'" in message and message.endswith(
        f"install {row.package} on a machine with that device")
    assert row.plugin not in sys.modules


def test_an_absent_accelerator_is_refused_in_one_line():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(DeviceError, match=r"^device 'cuda:1' is not available on this machine \(torch.cuda"):
        resolve_device("cuda:1")


def test_plugin_device_with_an_index_gets_the_tables_backend_activity_and_memory_history(tmp_path):
    found = probe_plugin(tmp_path, "npu")
    assert (found["device"], found["plain"]) == ("npu:1", "npu")
    assert found["missing"] == "device 'npu:2' does not exist: this machine has 2 npu device(s)"
    assert found["backend"] == "hccl" and found["autocast"] == "float16"
    assert found["activities"] == ["CPU", "PrivateUse1"]  # not the CPU only
    assert found["memory_history"] and found["warnings"] == []
    assert found["notes"] == ["NPU memory and the memory-history snapshot are recorded with --profile-memory only"]


def test_a_plugin_without_a_row_gets_the_privateuse1_rule(tmp_path):
    found = probe_plugin(tmp_path, "foo")
    assert found["device"] == "foo:1" and found["activities"] == ["CPU", "PrivateUse1"]
    assert found["memory_history"] and found["autocast"] == "float16"
    assert found["backend"].startswith("refused: multi-rank recording on device type 'foo' is not supported")


def test_the_backend_comes_from_the_table(monkeypatch):
    assert {name: backend_for(name) for name in ("cpu", "cuda", "npu", "mlu")} == {
        "cpu": "gloo", "cuda": "nccl", "npu": "hccl", "mlu": "cncl"}
    with pytest.raises(OneIterError, match="device type 'dipu' is not supported: expected one of cpu, cuda, npu, mlu$"):
        backend_for("dipu")
    monkeypatch.setitem(DEVICE_TYPES, "dipu", replace(DEVICE_TYPES["dipu"], backend="dicl"))
    assert backend_for("dipu") == "dicl"


def test_profiler_activities_come_from_the_table():
    assert activities(torch.device("cpu")) == [ProfilerActivity.CPU]
    assert activities(torch.device("cuda")) == [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    assert activities(torch.device("xpu")) == [ProfilerActivity.CPU, ProfilerActivity.XPU]
    # torch's own name for PrivateUse1 before a plugin renames it: the plugin rule
    assert device_type("privateuseone").activity == "PrivateUse1"
    assert activities(torch.device("privateuseone")) == [ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]
    assert profiler_activity("mps") is None and device_type("mps").backend is None


def head(device) -> dict:
    return summary_head(ProfileOptions(model="m", device=str(device)), parse_schedule("active=1"), device)


def test_a_torch_without_the_privateuse1_activity_is_warned_not_silent(monkeypatch):
    old = types.SimpleNamespace(CPU=ProfilerActivity.CPU, CUDA=ProfilerActivity.CUDA)  # torch < 2.3's members
    monkeypatch.setattr(torch.profiler, "ProfilerActivity", old)
    device = torch.device("privateuseone")
    assert activities(device) == [ProfilerActivity.CPU]
    (warning,) = head(device)["warnings"]
    assert warning.startswith("device 'privateuseone': torch.profiler records the CPU side only (this torch ")
    assert f"has no ProfilerActivity.PrivateUse1, which torch >= {devices.PRIVATEUSE1_SINCE} has)" in warning
    (warning,) = head(torch.device("mps"))["warnings"]
    assert "oneiter knows no profiler activity for device type 'mps'" in warning
    assert head(torch.device("cpu"))["warnings"] == [] and head(torch.device("cuda"))["warnings"] == []


def test_memory_history_comes_from_the_table(monkeypatch):
    assert memory_history_api("cuda") is torch.cuda.memory
    assert memory_history_api("cpu") is None and memory_history_api("dipu") is None
    assert head(torch.device("cuda"))["notes"] == [
        "CUDA memory and the memory-history snapshot are recorded with --profile-memory only"]
    monkeypatch.setitem(DEVICE_TYPES, "cuda", replace(DEVICE_TYPES["cuda"], memory_history=False))
    assert memory_history_api("cuda") is None
    assert head(torch.device("cuda"))["notes"] == [
        "device 'cuda' keeps no allocator history oneiter can read: no memory-history snapshot"]


def test_the_autocast_default_is_torchs_and_mmengine_reads_it(monkeypatch):
    if hasattr(torch, "get_autocast_dtype"):  # torch >= 2.4
        for name in ("cpu", "cuda", "xpu", "privateuseone"):
            assert getattr(torch, device_type(name).autocast_dtype) == torch.get_autocast_dtype(name)
    pytest.importorskip("mmengine")
    from mmengine.optim import AmpOptimWrapper

    from oneiter.integrations.mmengine import _amp_dtype

    class NoDtype(AmpOptimWrapper):  # mmengine refuses an AmpOptimWrapper on a machine without an accelerator
        def __init__(self):
            self.cast_dtype = None

    assert (_amp_dtype(NoDtype(), "cpu"), _amp_dtype(NoDtype(), "npu")) == (torch.bfloat16, torch.float16)
    monkeypatch.setitem(DEVICE_TYPES, "npu", replace(DEVICE_TYPES["npu"], autocast_dtype="bfloat16"))
    assert _amp_dtype(NoDtype(), "npu") == torch.bfloat16
