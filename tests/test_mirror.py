"""The tests mirror the package: a test file lives in the folder of `tests/` that has the path, under `oneiter/`, of
the package folder whose module it mainly tests (`tests/record/capture/` for `oneiter/record/capture/`), so a newcomer
finds a module's tests where the module is. Project-wide tests (layout, import order, docs) sit in `tests/` itself; the
folders named in `HELPERS` hold what tests run (model files), not tests, and mirror nothing.

pytest imports the test files in its default mode, as top-level modules (no `__init__.py` under `tests/`: each test
folder goes onto `sys.path`, which is how `from conftest import ...` and `import mutants` work), so two test files may
not share a name anywhere under `tests/`."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
PACKAGE = ROOT / "oneiter"
HELPERS = {"model_files": "model files the tests record and replay (stand-in plugins, faults, the zoo)"}
"""Top-level folders of `tests/` that hold no tests and mirror no package, each with what it holds."""


def test_folders(tests: Path = TESTS) -> list[Path]:
    """Every folder under `tests/` holding Python files, directly or below, helper folders and caches left out."""
    found: set[Path] = set()
    for path in tests.rglob("*.py"):
        rel = path.relative_to(tests)
        if rel.parts[0] in HELPERS or "__pycache__" in rel.parts or any(p.startswith(".") for p in rel.parts):
            continue
        folder = path.parent
        while folder != tests:
            found.add(folder)
            folder = folder.parent
    return sorted(found)


test_folders.__test__ = False  # a helper, not a test


def misplaced(tests: Path = TESTS, package: Path = PACKAGE) -> list[str]:
    """What breaks the mirror: a test folder with no package folder of that path, a test file in a folder whose package
    holds no module of its own (`judge/` has only subpackages), two test files of one name."""
    problems = []
    for folder in test_folders(tests):
        rel = folder.relative_to(tests)
        mirror = package / rel
        if not (mirror / "__init__.py").is_file():
            problems.append(f"tests/{rel.as_posix()}/: no package oneiter/{rel.as_posix()}/ (name the folder as the "
                            f"package it tests, or add it to HELPERS in tests/test_mirror.py)")
        elif list(folder.glob("test_*.py")) and not [p for p in mirror.glob("*.py") if p.name != "__init__.py"]:
            problems.append(f"tests/{rel.as_posix()}/: test files beside oneiter/{rel.as_posix()}/'s subpackages, "
                            f"which holds no module of its own: put each in the subpackage's folder it tests")
    seen: dict[str, Path] = {}
    for path in sorted(tests.rglob("test_*.py")):
        if "__pycache__" in path.parts:
            continue
        if path.name in seen:
            here, first = path.relative_to(tests.parent), seen[path.name].relative_to(tests.parent)
            problems.append(f"{here}: same name as {first} (pytest imports test files by name)")
        seen.setdefault(path.name, path)
    return problems


def test_every_test_folder_mirrors_a_package_folder():
    found = misplaced()
    assert not found, "tests that do not mirror the package:\n" + "\n".join(found)


def test_the_mirror_sees_the_subpackages_and_leaves_out_the_helper_folders():
    names = {f.relative_to(TESTS).as_posix() for f in test_folders()}
    assert {"record", "record/capture", "record/local", "judge/iteration", "judge/stepwise", "format"} <= names
    assert not any(n.split("/")[0] in HELPERS for n in names)
    assert all((TESTS / h).is_dir() for h in HELPERS)


def _tree(root: Path, files: list[str]) -> Path:
    for name in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("")
    return root


def test_a_misplaced_folder_a_test_beside_subpackages_and_a_repeated_name_are_each_named(tmp_path):
    package = _tree(tmp_path / "oneiter", ["__init__.py", "record/__init__.py", "record/recorder.py",
                                          "record/capture/__init__.py", "record/capture/hooks.py",
                                          "judge/__init__.py", "judge/stepwise/__init__.py", "judge/stepwise/band.py"])
    good = ["conftest.py", "test_layout.py", "record/test_record.py", "record/capture/test_hooks.py",
            "judge/stepwise/test_band.py", "model_files/twice.py"]
    assert misplaced(_tree(tmp_path / "good", good), package) == []

    wrong = _tree(tmp_path / "wrong", [*good, "record/captures/test_x.py", "judge/test_y.py",
                                      "judge/stepwise/test_hooks.py", "model_files/test_like.py"])
    found = misplaced(wrong, package)
    assert len(found) == 3, found
    assert found[0].startswith("tests/judge/: test files beside oneiter/judge/'s subpackages")
    assert found[1].startswith("tests/record/captures/: no package oneiter/record/captures/")
    assert found[2].startswith("wrong/record/capture/test_hooks.py: same name as wrong/judge/stepwise/test_hooks.py")
