"""The import graph of mk/: which module imports which, read with `ast` (nothing is
imported), its cycles, and the imports that sit inside a function or under
`if TYPE_CHECKING:`.

Every import counts as an arrow wherever it sits, so an import moved into a function (or
under TYPE_CHECKING) to dodge a cycle still closes the cycle here. `python
tools/import_graph.py` prints the counts, each cycle with its arrows, and the late
imports; it exits 1 when there is a cycle. tests/test_import_graph.py runs `cycles` on mk/.

Not here: which floor a module stands on (STYLE.md's order), the arrows of tests/,
notebooks/ and tools/.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def modules(root: Path = ROOT, package: str = "mk") -> dict[str, Path]:
    """{dotted name: file} of every module of `package` under `root`."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _targets(name: str, node: ast.Import | ast.ImportFrom, is_package: bool,
             known: dict) -> list[str]:
    """The modules of `known` an import statement of module `name` reaches: a
    `from package import module` reaches the module, any other name its module."""
    def owner(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    if isinstance(node, ast.Import):
        found = [owner(alias.name) for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            here = name.split(".") if is_package else name.split(".")[:-1]
            here = here[:len(here) - node.level + 1]
            base = ".".join(here + ([node.module] if node.module else []))
        found = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else owner(base)
                 for a in node.names]
    return [t for t in dict.fromkeys(found) if t and t != name]


def imports(known: dict[str, Path]) -> list[tuple[str, str, str, int]]:
    """(importer, imported, where, line) of every import between modules of `known`;
    where is "top", "function" (inside a def) or "typing" (under `if TYPE_CHECKING:`)."""
    out = []
    for name, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        where = {}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                where |= {id(n): "function" for n in ast.walk(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                where |= {id(n): "typing" for n in ast.walk(node)}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(name, node, path.name == "__init__.py", known):
                    out.append((name, target, where.get(id(node), "top"), node.lineno))
    return out


def cycles(arrows) -> list[list[str]]:
    """The strongly connected components of more than one module (each a cycle or a knot
    of them), each sorted, by Tarjan's algorithm."""
    graph: dict[str, set[str]] = {}
    for a, b, *_ in arrows:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def main() -> int:
    arrows = imports(modules())
    pairs = {(a, b) for a, b, *_ in arrows}
    knots = cycles(arrows)
    late = [a for a in arrows if a[2] != "top"]
    print(f"{len(modules())} modules, {len(pairs)} arrows, {len(knots)} cycles, "
          f"{len(late)} late imports (in a function or under TYPE_CHECKING)")
    for knot in knots:
        print("cycle:", " ".join(knot))
        for a, b, where, line in arrows:
            if a in knot and b in knot:
                print(f"    {a} -> {b} ({where}, line {line})")
    for a, b, where, line in late:
        print(f"late: {a}:{line} -> {b} ({where})")
    return 1 if knots else 0


if __name__ == "__main__":
    sys.exit(main())
