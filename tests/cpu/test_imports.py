"""The layers, read from the source's imports (every import statement, inside functions too):
no module imports a module of a layer above its own, and no two modules import each other,
directly or around a circle (docs/architecture.md, "Layers")."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
API = {"cute_flash", "cute_flash.interface", "cute_flash.flash_attn_interface", "cute_flash._validate",
       "cute_flash.autograd", "cute_flash.ops", "cute_flash.dropout", "cute_flash.sinks",
       "cute_flash.kvcache_varlen", "cute_flash.reference", "cute_flash.mods"}
LAYERS = ["layouts", "kernels", "compile", "launch", "api", "integrations", "tools"]  # bottom to top


def layer(module: str) -> str:
    if module.startswith("layouts"):
        return "layouts"
    if module.startswith("cute_flash.kernels"):
        return "kernels"
    if module == "cute_flash.compile" or module.startswith("cute_flash.compile."):
        return "compile"
    if module.startswith("cute_flash.launch"):
        return "launch"
    if module in API:
        return "api"
    if module.startswith("cute_flash.integrations"):
        return "integrations"
    if module.startswith("cute_flash.tools") or module == "cute_flash.__main__":
        return "tools"
    raise AssertionError(f"{module} belongs to no layer: place it in one (tests/cpu/test_imports.py)")


def modules() -> dict:
    found = {}
    for package in ("cute_flash", "layouts"):
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports(name: str, path: Path, known) -> set:
    """The package's modules `name` imports: `from pkg import sub` names the submodule, not pkg."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
            subs = [f"{base}.{a.name}" for a in node.names]
            out |= {s for s in subs if s in known} or {base}
    return {m for m in out if m in known and m != name}


def graph() -> dict:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_every_module_imports_only_its_layer_and_below():
    upward = [f"{m} ({layer(m)}) imports {d} ({layer(d)})" for m, deps in graph().items() for d in sorted(deps)
              if LAYERS.index(layer(d)) > LAYERS.index(layer(m))]
    assert not upward, "\n".join(upward)


def test_no_import_circles():
    edges = graph()
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    assert not circles, circles


def test_the_check_sees_an_upward_import_and_a_circle(tmp_path, monkeypatch):
    """Not vacuous: a kernel and a compile module importing the launch layer, and two launch
    modules importing each other, are found."""
    for rel, text in (("cute_flash/kernels/k.py", "from cute_flash.launch import a\n"),
                      ("cute_flash/launch/a.py", "from cute_flash.launch import b\n"),
                      ("cute_flash/launch/b.py", "import cute_flash.launch.a\n"),
                      ("cute_flash/compile/c.py", "from cute_flash.launch.a import x\n"),
                      ("cute_flash/launch/__init__.py", ""), ("cute_flash/kernels/__init__.py", ""),
                      ("cute_flash/compile/__init__.py", ""), ("layouts/__init__.py", "")):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    edges = graph()
    assert edges["cute_flash.kernels.k"] == {"cute_flash.launch.a"}
    assert edges["cute_flash.compile.c"] == {"cute_flash.launch.a"}  # the compile layer's, upward too
    assert layer("cute_flash.compile") == layer("cute_flash.compile.c") == "compile"
    assert edges["cute_flash.launch.a"] == {"cute_flash.launch.b"} and edges["cute_flash.launch.b"] == {
        "cute_flash.launch.a"}
    for test in (test_every_module_imports_only_its_layer_and_below, test_no_import_circles):
        try:
            test()
        except AssertionError:
            continue
        raise AssertionError(f"{test.__name__} passed on a tree that breaks it")
