"""Draw oneiter's import graph between its layers (subpackages and top-level modules).

    python tools/imports.py            # one line per edge: `record -> format  12 (3 in functions)`
    python tools/imports.py --all      # every import: `oneiter.record.run -> oneiter.runtime.devices`
    python tools/imports.py --dot      # the layer graph for Graphviz (`| dot -Tpng -o imports.png`)

What may import what is enforced by tests/test_import_order.py; this only shows what is there.
"""

from __future__ import annotations

import argparse
import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def module_name(path: Path) -> str:
    """`oneiter/format/schema.py` -> `oneiter.format.schema`; a package's `__init__.py` keeps `.__init__`."""
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file() or \
        any(path.parent.glob(path.name + ".*.so"))


def imports(source: str, module: str) -> list[tuple[int, str, bool]]:
    """(line, imported oneiter module, inside a function) for every import in the code `source` of `module`:
    relative imports resolved, `from oneiter import models` counted as the subpackage, `from m import a, b` once.
    tests/test_import_order.py judges these against the layer table."""
    tree = ast.parse(source)
    package = module if module.endswith("__init__") else module.rpartition(".")[0]
    package = package.removesuffix(".__init__")
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((child.lineno, a.name, inner) for a in child.names if a.name.split(".")[0] == "oneiter")
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - child.level + 1] + ([base] if base else []))
                if base.split(".")[0] == "oneiter":
                    for alias in child.names:
                        sub = f"{base}.{alias.name}"
                        found.append((child.lineno, sub if is_module(sub) else base, inner))
            visit(child, inner)

    visit(tree, False)
    return list(dict.fromkeys(found))


def layer(module: str) -> str:
    """`oneiter.format.schema` -> `format`; a top-level module is its own layer (`api`, `errors`)."""
    parts = module.split(".")
    return "oneiter" if len(parts) == 1 else parts[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="every import, not only the edges between layers")
    parser.add_argument("--dot", action="store_true", help="Graphviz source of the layer graph")
    args = parser.parse_args()
    edges: Counter = Counter()
    lazy: Counter = Counter()
    for path in sorted((ROOT / "oneiter").rglob("*.py")):
        source = module_name(path).removesuffix(".__init__")
        for _, target, inside in imports(path.read_text(encoding="utf-8"), module_name(path)):
            if args.all:
                print(f"{source} -> {target}{'  (in a function)' if inside else ''}")
            a, b = layer(source), layer(target)
            if a != b:
                edges[a, b] += 1
                lazy[a, b] += inside
    if args.all:
        return
    if args.dot:
        print("digraph oneiter {\n  rankdir=LR;")
        for (a, b), n in sorted(edges.items()):
            print(f'  "{a}" -> "{b}" [label="{n}"];')
        print("}")
        return
    for (a, b), n in sorted(edges.items()):
        print(f"{a:>14} -> {b:<14} {n:3d}" + (f" ({lazy[a, b]} in functions)" if lazy[a, b] else ""))


if __name__ == "__main__":
    main()
