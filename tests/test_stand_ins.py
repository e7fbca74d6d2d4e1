"""A fault never cooperates with the tool: the tests' stand-ins know nothing of oneiter, and oneiter nothing of them.

The stand-ins are the files of tests/model_files: the wrong kernels a vendor plugin would register
(`faulty_kernels.py`, `tf32kit.py`) and the Python-level faults a vendor's stack would patch in (`faultkit.py`) may
not import oneiter, name it in code, or ask it anything (whether a calibration is running, as
`faulty_kernels.install(..., device_only=True)` once did through `oneiter.record.modes.trusted`): a tool that can
only pass with their help is wrong. The user models that use them import nothing of oneiter where the model is
built; only a user's training script in one of them adds oneiter's callback, as a user's does. And oneiter's own
code never names them (only its docs may), so it cannot recognise a test's fault and treat it differently from a
real one.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import MODEL_FILES, load_tool

imports = load_tool("imports").imports

ROOT = Path(__file__).resolve().parent.parent
STAND_INS = sorted(MODEL_FILES.glob("*.py"))
KERNEL_STAND_INS = ("faulty_kernels", "tf32kit", "faultkit", "scaled_mm_kernels", "half_kernels")
# what names a stand-in in oneiter's code: its module, the variables the tests set for it
STAND_IN_NAMES = (*KERNEL_STAND_INS, "FAULTY_KERNEL", "ONEITER_TEST_")
# model files that are also a user's training script, and the oneiter modules their script part imports
USER_SCRIPTS = {"lightning_llama.py": ("oneiter.integrations.lightning",)}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants of a module, its classes and its functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _code_mentions(path: Path, words: tuple[str, ...]) -> list[str]:
    """Where the code of `path` (names, attributes, imports, string constants; not its docstrings nor comments)
    holds one of `words`, as `line: text`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs = _docstrings(tree)
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            text = node.value
        elif isinstance(node, ast.Name):
            text = node.id
        elif isinstance(node, ast.Attribute):
            text = node.attr
        elif isinstance(node, ast.alias):
            text = node.name
        elif isinstance(node, ast.ImportFrom):
            text = node.module or ""
        elif isinstance(node, ast.keyword):
            text = node.arg or ""
        elif isinstance(node, ast.arg):
            text = node.arg
        else:
            continue
        hits += [f"{getattr(node, 'lineno', '?')}: {text}" for word in words if word in text]
    return hits


def test_the_kernel_and_fault_stand_ins_are_model_files():
    assert {p.stem for p in STAND_INS} >= set(KERNEL_STAND_INS)


@pytest.mark.parametrize("name", KERNEL_STAND_INS)
def test_a_kernel_or_fault_stand_in_never_imports_or_names_oneiter(name):
    path = MODEL_FILES / f"{name}.py"
    assert imports(path.read_text(encoding="utf-8"), f"tests.model_files.{name}") == []
    assert _code_mentions(path, ("oneiter", "device_only")) == []


@pytest.mark.parametrize("path", STAND_INS, ids=lambda p: p.name)
def test_a_model_file_imports_oneiter_only_in_its_users_script(path):
    """A model and its faults import nothing of oneiter; a user's training script (`main`) may add oneiter's
    callback, as a user's does, inside the function that runs it (`USER_SCRIPTS`), never where the model is built."""
    found = imports(path.read_text(encoding="utf-8"), f"tests.model_files.{path.stem}")
    assert [m for _, m, inside in found if not inside] == []
    assert {m for _, m, _ in found} <= set(USER_SCRIPTS.get(path.name, ()))
    assert _code_mentions(path, ("device_only", "trusted")) == []


def test_the_scan_finds_what_the_old_plugin_did(tmp_path):
    """The check above fails on the stand-in as it was: a hook asking oneiter whether a calibration runs."""
    old = tmp_path / "old_plugin.py"
    old.write_text('"""names oneiter in its docs only: fine"""\n'
                   "def _scaled(out, device_only):\n"
                   "    if device_only:\n"
                   "        from oneiter.record.modes import trusted\n"
                   "        if trusted.active():\n"
                   "            return out\n"
                   "    return out * 1.001\n"
                   "mod = __import__('oneiter')\n")
    assert [m for _, m, _ in imports(old.read_text(), "old_plugin")] == ["oneiter.record.modes.trusted"]
    assert sorted(_code_mentions(old, ("oneiter", "device_only"))) == [
        "2: device_only", "3: device_only", "4: oneiter.record.modes", "8: oneiter"]


def test_installing_every_stand_in_loads_no_oneiter_module():
    """At run time too (whatever they import, however indirectly): install each kernel and fault, run it."""
    code = ("import json, sys, torch\n"
            f"sys.path.insert(0, {str(MODEL_FILES)!r})\n"
            "import faulty_kernels, tf32kit, faultkit, scaled_mm_kernels, half_kernels\n"
            "x = torch.randn(4, 8, requires_grad=True)\n"
            "scaled_mm_kernels.install()\n"
            "f8 = torch.randn(16, 16).to(torch.float8_e4m3fn)\n"
            "torch._scaled_mm(f8, f8.t(), torch.tensor(1.0), torch.tensor(1.0), out_dtype=torch.float32)\n"
            "half_kernels.install()\n"
            "torch.nn.functional.linear(x.half(), torch.randn(3, 8).half(), torch.randn(3).half())\n"
            "for name in ('silu', 'silu_backward'):\n"
            "    faulty_kernels.install(name)\n"
            "    torch.nn.functional.silu(x).sum().backward()\n"
            "tf32kit.install()\n"
            "torch.nn.functional.linear(x, torch.randn(3, 8)).sum().backward()\n"
            "import os\n"
            "os.environ[faultkit.ENV] = 'function:silu'\n"
            "faultkit.patch_functions()\n"
            "torch.nn.functional.silu(x)\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'oneiter')))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_oneiters_code_never_names_a_stand_in():
    """Only oneiter's docs may say which stand-ins its tests use; its code cannot tell them from a real plugin."""
    hits = {str(p.relative_to(ROOT)): found for p in sorted((ROOT / "oneiter").rglob("*.py"))
            if (found := _code_mentions(p, STAND_IN_NAMES))}
    assert hits == {}
