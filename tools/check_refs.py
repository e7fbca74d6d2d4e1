"""Every file or module that a docstring, a comment or a doc names must exist.

Docs rot silently: a module docstring that sends the reader to a page or a module that was renamed costs the next
reader an afternoon. This check reads

- the docstrings (a field's too) and comments of every Python file under oneiter/, tests/, bench/ and tools/
  (not its other string literals: a test's temporary `t.toml` is no reference), and
- README.md, CONTRIBUTING.md and docs/*.md,

and resolves what they name:

- a *path* (`docs/blame.md`, `record/local/probe.py`, `oneiter/format/_statskernel.c`, `.ci/run`, a Markdown link's
  target): relative to the repository, to oneiter/, to the naming file's folder, or to its package; a bare file name
  (`recorder.py`) must be some tracked file's name;
- a *module* in backticks (`judge.iteration.verdict`, `oneiter.report.terminal.to_json`, `format.stats.KERNEL`): the
  longest
  prefix that is a module or package of oneiter, then at most two names defined in it (a function, a class, a
  constant, a class's method).

Names of the user's own files in examples (`my_model.py`, `ref.h5`) are listed in EXAMPLES. Run from anywhere:
`python tools/check_refs.py` prints one line per broken reference (`file:line: 'name' ...`) and exits 1, or exits 0.
"""

from __future__ import annotations

import ast
import functools
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "oneiter"
SUBPACKAGES = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
SUFFIXES = ("py", "md", "c", "toml", "txt", "cfg", "yaml", "yml", "sh")
# Files a user writes, named in examples and help texts, and other projects' files: never files of this repository.
EXAMPLES = {"my_model.py", "my_llm.py", "file.py", "npu.toml", "npu.py", "t.toml", "rec.txt", "device_configs.py",
            "trainer_example.py", "repro.py", "my_plugin.py", "activations.py", "diopi_configs.py", "gen_input.py",
            "check_result.py", "acc_check.py", "pytorch_data_dump_instruct.md", "pytorch_accuracy_checker_instruct.md",
            "lit_example.py", "accelerate_example.py", "titan_model.py", "run_train.sh"}
PATH = re.compile(r"(?<![\w/.:-])((?:\.{0,2}/)?(?:[\w.-]+/)*[\w-]+\.(?:%s))(?![\w/])" % "|".join(SUFFIXES))
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
TICKED = re.compile(r"`([A-Za-z_][\w.]*)`")
SPECIAL = {".ci/run"}


@functools.lru_cache(maxsize=None)
def tracked() -> frozenset[str]:
    """Tracked files and untracked ones git does not ignore, relative to ROOT."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return frozenset(out.split())


@functools.lru_cache(maxsize=None)
def basenames() -> frozenset[str]:
    return frozenset(Path(p).name for p in tracked())


def path_exists(name: str, source: Path) -> bool:
    """`name` (a path as written) resolves from one of the places a reader would look."""
    if name in SPECIAL or Path(name).name in EXAMPLES:
        return True
    if "/" not in name:
        return name in basenames()
    bases = [ROOT, PACKAGE, source.parent, *source.parents]
    # only inside the repository: a clean clone has nothing beside it, so a reference out of it is a broken one
    found = [(base / name).resolve() for base in bases if (base / name).exists()]
    return any(p == ROOT or ROOT in p.parents for p in found)


@functools.lru_cache(maxsize=None)
def defined_names(module: Path) -> frozenset[str]:
    """Top-level names of a module, with `Class.method` for its classes' members."""
    tree = ast.parse(module.read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(f"{node.name}.{item.name}")
                        names.update(f"{node.name}.{attr}" for attr in _instance_attributes(item))
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        names.add(f"{node.name}.{item.target.id}")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return frozenset(names)


def _instance_attributes(method: ast.AST) -> set[str]:
    """The attributes a method sets on `self` (`self.values = ...`)."""
    return {t.attr for node in ast.walk(method) if isinstance(node, (ast.Assign, ast.AnnAssign))
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


def module_file(parts: list[str]) -> Path | None:
    base = PACKAGE.joinpath(*parts)
    if (base / "__init__.py").exists():
        return base / "__init__.py"
    return base.with_suffix(".py") if base.with_suffix(".py").exists() else None


def module_exists(dotted: str) -> bool:
    """`judge.iteration.verdict.decide` or `oneiter.report.terminal`: a module of oneiter, then names defined in it."""
    parts = dotted.split(".")
    if parts[0] == "oneiter":
        parts = parts[1:]
    if not parts or parts[0] not in SUBPACKAGES:
        return True  # not a reference into oneiter (`torch.cuda`, `result.culprit`)
    for cut in range(len(parts), 0, -1):
        found = module_file(parts[:cut])
        if found is not None:
            rest = ".".join(parts[cut:])
            return not rest or rest in defined_names(found) or len(parts) - cut > 2
    return False


def references(text: str) -> list[tuple[int, str, str]]:
    """(line, kind, name) of every path and oneiter module named in `text`."""
    found: list[tuple[int, str, str]] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for match in LINK.finditer(line):
            if "://" not in match.group(1) and not match.group(1).startswith("mailto:"):
                found.append((lineno, "path", match.group(1)))
        for match in PATH.finditer(line):
            found.append((lineno, "path", match.group(1)))
        for match in TICKED.finditer(line):
            name = match.group(1)
            if "." in name and not re.search(r"\.(%s)$" % "|".join(SUFFIXES), name):
                found.append((lineno, "module", name))
    return list(dict.fromkeys(found))  # a link's target is a path too: once


def prose(source: Path) -> str:
    """What of a file is prose: a doc's whole text; a Python file's docstrings and comments, at their own lines."""
    text = source.read_text()
    if source.suffix != ".py":
        return text
    lines = [""] * (text.count("\n") + 1)
    for node in ast.walk(ast.parse(text)):
        # docstrings, and the strings documenting a field or a constant (a bare string statement after it)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for offset, line in enumerate(node.value.value.splitlines()):
                lines[node.lineno - 1 + offset] += " " + line
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            lines[token.start[0] - 1] += " " + token.string
    return "\n".join(lines)


def check_text(text: str, source: Path) -> list[str]:
    problems = []
    for lineno, kind, name in references(text):
        ok = path_exists(name, source) if kind == "path" else module_exists(name)
        if not ok:
            what = "no such file" if kind == "path" else "no such module or name in oneiter"
            problems.append(f"{source.relative_to(ROOT)}:{lineno}: {name!r}: {what}")
    return problems


def sources() -> list[Path]:
    files = [ROOT / p for p in sorted(tracked())]
    wanted = []
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        if path.suffix == ".py" and rel.split("/")[0] in {"oneiter", "tests", "bench", "tools"}:
            wanted.append(path)
        elif rel in {"README.md", "CONTRIBUTING.md"} or (rel.startswith("docs/") and path.suffix == ".md"):
            wanted.append(path)
    return [p for p in wanted if p.exists()]


def main() -> int:
    problems = [p for source in sources() for p in check_text(prose(source), source)]
    for line in problems:
        print(line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
