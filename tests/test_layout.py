"""The package's folders stay a house a newcomer can walk: no folder holds more than `MAX_MODULES` modules (split
it by concern into subpackages, as `record/` and `judge/` are), and every package's `__init__` docstring is a map
naming each of its modules and subpackages, one line each, and nothing that does not exist."""

from __future__ import annotations

import ast
import functools
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "oneiter"
MAX_MODULES = 16


def folders() -> list[Path]:
    """Every folder of the package that holds Python code (caches left out)."""
    return sorted(p for p in [PACKAGE, *PACKAGE.rglob("*")] if p.is_dir() and p.name != "__pycache__"
                  and any(p.glob("*.py")))


def modules(folder: Path) -> list[str]:
    """The modules of a folder: its `.py` files but `__init__.py`."""
    return sorted(p.stem for p in folder.glob("*.py") if p.name != "__init__.py")


def crowded(limit: int = MAX_MODULES) -> list[str]:
    return [f"{folder.relative_to(ROOT)}: {len(modules(folder))} modules" for folder in folders()
            if len(modules(folder)) > limit]


def test_no_folder_holds_more_than_16_modules():
    found = crowded()
    assert not found, f"folders of more than {MAX_MODULES} modules (split them by concern):\n" + "\n".join(found)


def test_the_folder_count_sees_the_folders():
    """The check itself: it sees the subpackages and counts a folder's modules (a limit below the largest fails)."""
    names = {f.relative_to(ROOT).as_posix() for f in folders()}
    assert {"oneiter", "oneiter/record/local", "oneiter/judge/iteration", "oneiter/format"} <= names
    assert "__init__" not in modules(PACKAGE / "record") and "recorder" in modules(PACKAGE / "record")
    largest = max(len(modules(f)) for f in folders())
    assert crowded(largest - 1) and not crowded(largest)


# -- package maps -----------------------------------------------------------------------------------------------------
MAP_LINE = re.compile(r"^- `([A-Za-z_][A-Za-z0-9_]*(?:\.py|/))`", re.M)


def packages() -> list[Path]:
    return [f for f in folders() if (f / "__init__.py").is_file()]


def parts(folder: Path) -> set[str]:
    """What a package's map must name: its modules (their file names) and subpackages (their names and a slash)."""
    subpackages = {f"{p.name}/" for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    return {f"{m}.py" for m in modules(folder)} | subpackages


def mapped(folder: Path) -> set[str]:
    """The names the package's `__init__` docstring maps: its lines that start with a dash and a backquoted module
    file name or subpackage name (`MAP_LINE`)."""
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text(encoding="utf-8"))) or ""
    return set(MAP_LINE.findall(doc))


def map_errors(folder: Path) -> list[str]:
    rel = (folder / "__init__.py").relative_to(ROOT)
    missing, stale = sorted(parts(folder) - mapped(folder)), sorted(mapped(folder) - parts(folder))
    return [f"{rel}: the map names no {name}" for name in missing] + [
        f"{rel}: the map names {name}, which does not exist" for name in stale]


def test_every_package_map_names_its_modules_and_nothing_else():
    found = [line for folder in packages() for line in map_errors(folder)]
    assert not found, "package maps out of date (one line `- `name.py` what it is` each):\n" + "\n".join(found)


def test_the_map_check_sees_what_a_map_lacks_or_invents(tmp_path, monkeypatch):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    for name in ("__init__.py", "a.py", "b.py", "sub/__init__.py"):
        (package / name).write_text('"""- `sub/` x"""\n' if name == "sub/__init__.py" else "")
    (package / "__init__.py").write_text('"""The map.\n\n- `a.py`   one\n- `gone.py` two\n- `sub/`    three\n"""\n')
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert map_errors(package) == ["pkg/__init__.py: the map names no b.py",
                                   "pkg/__init__.py: the map names gone.py, which does not exist"]


# -- sizes: rooms a reader sees whole ---------------------------------------------------------------------------------
MAX_LINES, MAX_CLASS_LINES, MAX_FUNCTION_LINES = 600, 400, 60


def sources() -> list[Path]:
    """Every Python module of the package (caches left out)."""
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


@functools.lru_cache(maxsize=1)
def sizes() -> dict[str, dict[str, int]]:
    """Lines of every module, class and function (methods and nested functions included) of the package; a class or
    function counts from its `def`/`class` line to its last (`end_lineno - lineno + 1`: decorators excluded)."""
    found: dict[str, dict[str, int]] = {"module": {}, "class": {}, "function": {}}
    for path in sources():
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(ROOT).as_posix()
        found["module"][rel] = len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                found[kind][f"{rel}:{node.lineno} {node.name}"] = node.end_lineno - node.lineno + 1
    return found


def oversized(kind: str, limit: int, found: dict[str, dict[str, int]] | None = None) -> list[str]:
    found = sizes() if found is None else found
    return [f"{name}: {lines} lines" for name, lines in sorted(found[kind].items()) if lines > limit]


def test_no_module_is_over_600_lines():
    found = oversized("module", MAX_LINES)
    assert not found, f"modules over {MAX_LINES} lines (split them by concern):\n" + "\n".join(found)


def test_no_class_is_over_400_lines():
    found = oversized("class", MAX_CLASS_LINES)
    assert not found, f"classes over {MAX_CLASS_LINES} lines (split them by concern):\n" + "\n".join(found)


def test_no_function_is_over_60_lines():
    found = oversized("function", MAX_FUNCTION_LINES)
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines (split them):\n" + "\n".join(found)


def test_the_size_checks_see_modules_classes_and_functions():
    """The check itself: it measures every module, class, method and nested function (a limit just below the
    largest of each kind fails, the largest itself passes), from the `def` line to the last line."""
    found = sizes()
    assert "oneiter/format/layout.py" in found["module"]
    assert any(name.endswith(" IterationFile") for name in found["class"])
    assert any(name.endswith(" __init__") for name in found["function"])  # methods are functions too
    for kind in ("module", "class", "function"):
        largest = max(found[kind].values())
        assert oversized(kind, largest - 1, found) and not oversized(kind, largest, found)
    source = "@staticmethod\ndef f():\n    def g():\n        return 1\n    return g\n"
    lines = {n.name: n.end_lineno - n.lineno + 1 for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)}
    assert lines == {"f": 4, "g": 2}


# -- names: one meaning each ------------------------------------------------------------------------------------------
def shared_names(paths: list[Path], root: Path) -> list[str]:
    """The names that more than one of `paths` bears, each with where (relative to `root`)."""
    where: dict[str, list[str]] = {}
    for path in paths:
        where.setdefault(path.name, []).append(path.relative_to(root).as_posix())
    return [f"{name}: {', '.join(sorted(places))}" for name, places in sorted(where.items()) if len(places) > 1]


def module_files(package: Path) -> list[Path]:
    """The package's module files but the ones every package has (`__init__.py`, `__main__.py`)."""
    return sorted(p for p in package.rglob("*.py") if "__pycache__" not in p.parts
                  and p.name not in ("__init__.py", "__main__.py"))


def subfolders(package: Path) -> list[Path]:
    return sorted(p for p in package.rglob("*") if p.is_dir() and p.name != "__pycache__")


def test_no_two_modules_share_a_file_name():
    found = shared_names(module_files(PACKAGE), ROOT)
    assert not found, "module file names used twice (give each one name for what it holds):\n" + "\n".join(found)


def test_no_two_folders_share_a_name():
    found = shared_names(subfolders(PACKAGE), ROOT)
    assert not found, "folder names used twice (give each one name for what it holds):\n" + "\n".join(found)


def test_the_name_checks_see_a_name_used_twice(tmp_path):
    """The check itself: a module name and a folder name used twice are found, `__init__.py` is not."""
    for name in ("a/__init__.py", "a/steps/__init__.py", "a/steps/x.py", "a/b/__init__.py", "a/b/steps/x.py",
                 "a/b/y.py", "a/__main__.py", "a/b/__main__.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    assert shared_names(module_files(tmp_path / "a"), tmp_path) == ["x.py: a/b/steps/x.py, a/steps/x.py"]
    assert shared_names(subfolders(tmp_path / "a"), tmp_path) == ["steps: a/b/steps, a/steps"]
