"""The package's folders stay a house a newcomer can walk: no folder holds more than `MAX_MODULES` modules (split
it by concern into subpackages, as `record/` and `judge/` are), and every package's `__init__` docstring is a map
naming each of its modules and subpackages, one line each, and nothing that does not exist."""

from __future__ import annotations

import ast
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
