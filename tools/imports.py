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
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[str, bool]]:
    """(imported oneiter module, inside a function) for every import statement of `path`."""
    name = module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    tree = ast.parse(path.read_text())
    found = []

    def visit(node, inside: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.ImportFrom):
                base = package[:len(package) - child.level + 1] if child.level else []
                target = ".".join(base + ([child.module] if child.module else []))
                if target == "oneiter":  # `from oneiter import models` imports the subpackage
                    found.extend((f"oneiter.{alias.name}", nested) for alias in child.names
                                 if (ROOT / "oneiter" / alias.name).is_dir())
                    continue
                found.append((target, nested))
            elif isinstance(child, ast.Import):
                found.extend((alias.name, nested) for alias in child.names)
            visit(child, nested)

    visit(tree, False)
    return [(t, inside) for t, inside in found if t == "oneiter" or t.startswith("oneiter.")]


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
        source = module_name(path)
        for target, inside in imports(path):
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
