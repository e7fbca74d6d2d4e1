"""The package's folders stay a house a newcomer can walk: no folder holds more than `MAX_MODULES` modules (split
it by concern into subpackages, as `record/` and `judge/` are)."""

from __future__ import annotations

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

