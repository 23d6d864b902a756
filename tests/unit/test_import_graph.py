"""The package's import graph stays clean: no import circles (counting imports inside functions, which only
hide a circle), and no `from X import _private` across modules. Parsed with ast, nothing is imported."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/unit/ -> root
PACKAGE = "livemoe"
EXTENSIONS = {"livemoe._C"}  # the compiled extension (built by setup.py), named as torch's and vLLM's are


def modules() -> dict[str, str]:
    """dotted module name -> file, for every module of the package (a package's is its __init__.py)."""
    found = {}
    for folder, _, files in os.walk(os.path.join(ROOT, PACKAGE)):
        for f in files:
            if f.endswith(".py"):
                parts = os.path.relpath(os.path.join(folder, f), ROOT)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts.pop()
                found[".".join(parts)] = os.path.join(folder, f)
    return found


def imports(name: str, path: str, known: dict) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every import of a package module in `path`."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name in known]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != PACKAGE:
                continue
            names = [a.name for a in node.names]
            submodules = [n for n in names if f"{base}.{n}" in known]
            out += [(f"{base}.{n}", [], node.lineno) for n in submodules]
            rest = [n for n in names if n not in submodules]
            if rest or not submodules:
                out.append((base, rest, node.lineno))
    return out


def graph() -> tuple[dict[str, set], list[str]]:
    known = modules() | {name: "" for name in EXTENSIONS}
    edges, private = {}, []
    for name, path in known.items():
        edges[name] = set()
        if not path:
            continue
        for target, names, line in imports(name, path, known):
            assert target in known, f"{path}:{line} imports {target}, which is not a module of {PACKAGE}"
            if target != name:
                edges[name].add(target)
            private += [f"{os.path.relpath(path, ROOT)}:{line}: from {target} import {n}" for n in names
                        if n.startswith("_") and not n.startswith("__") and target != name]
    return edges, private


def cycles(edges: dict[str, set]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_checker_sees_imports_and_circles():
    edges, _ = graph()
    assert "livemoe.engine.llm" in edges["livemoe.engine.async_llm"]  # a real edge is seen
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    found = cycles(graph()[0])
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_private_imports_across_modules():
    private = graph()[1]
    assert not private, "private names imported from another module:\n" + "\n".join(private)
