"""The house reads in one direction (docs/development.md): the import contracts in pyproject.toml
hold, no module imports one that imports it back (a package's __init__ included: importing
`a.b.c` runs `a/__init__.py` and `a/b/__init__.py` first), the config imports no component, and
no module outgrows a reading."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

grimp = pytest.importorskip("grimp")

LARGEST = 400  # lines: a module past this is two rooms


def test_the_layers_contract_holds():
    """lint-imports (import-linter) on pyproject's contracts: each layer imports only the layers
    below it, the rooms of one layer not each other."""
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert exe, "import-linter is not installed: pip install -e '.[dev]'"
    proc = subprocess.run([exe, "--no-cache"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def _imports(graph, module: str) -> set[str]:
    """What importing `module` runs: each module it imports and, as Python does, every package
    above each of those (`from a.b import c` runs a/__init__.py and a/b/__init__.py first).
    grimp records only the module named, so a cycle through a package's __init__ (the package
    re-exports a module that imports its sibling through the package) would go unseen."""
    out = set()
    for imported in graph.find_modules_directly_imported_by(module):
        parts = imported.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return (out & graph.modules) - {module}


def _cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), over `_imports`."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in _imports(graph, v):
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
                found.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def test_no_module_imports_one_that_imports_it_back():
    assert _cycles(grimp.build_graph("ddpgpt")) == []


def test_the_cycle_finder_finds_a_cycle(tmp_path, monkeypatch):
    """The oracle for the test above: two modules importing each other are one cycle."""
    pkg = tmp_path / "loop_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from loop_pkg import b\n")
    (pkg / "b.py").write_text("import loop_pkg.a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _cycles(grimp.build_graph("loop_pkg", cache_dir=None)) == [["loop_pkg.a",
                                                                        "loop_pkg.b"]]


def test_the_cycle_finder_finds_a_cycle_through_a_package_init(tmp_path, monkeypatch):
    """The oracle for a cycle that no two modules show by name: the package's __init__
    re-exports `a`, and `a` imports its sibling `b`, which runs the package's __init__ first."""
    pkg = tmp_path / "face_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from face_pkg.a import f  # noqa: F401\n")
    (pkg / "a.py").write_text("from face_pkg.b import g\n\ndef f():\n    return g()\n")
    (pkg / "b.py").write_text("def g():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("face_pkg", cache_dir=None)
    assert graph.find_modules_directly_imported_by("face_pkg.a") == {"face_pkg.b"}  # no cycle
    assert _cycles(graph) == [["face_pkg", "face_pkg.a"]]
    (pkg / "__init__.py").write_text('"""A package that re-exports nothing."""\n')
    assert _cycles(grimp.build_graph("face_pkg", cache_dir=None)) == []


def test_the_config_imports_no_component():
    """config/ is the ground: it imports nothing of ddpgpt but errors (and itself)."""
    graph = grimp.build_graph("ddpgpt")
    config = graph.find_children("ddpgpt.config") | {"ddpgpt.config"}
    reached = {i for m in config for i in graph.find_modules_directly_imported_by(m)}
    assert {m for m in reached if m.startswith("ddpgpt")} - config == {"ddpgpt.errors"}


def test_no_module_outgrows_a_reading():
    sizes = {p.relative_to(REPO): len(p.read_text().splitlines())
             for p in (REPO / "ddpgpt").rglob("*.py")}
    assert {p: n for p, n in sizes.items() if n > LARGEST} == {}


def test_files_are_replaced_only_through_files_py():
    """The temporary file renamed over its name (files.atomic_write) is written once: no module
    but files.py calls os.replace."""
    calls = {p.relative_to(REPO) for p in (REPO / "ddpgpt").rglob("*.py")
             if "os.replace(" in p.read_text()}
    assert calls == {Path("ddpgpt/files.py")}


# Modules allowed to rename a path outside files.py, each with the reason (none needed today).
RENAMES_ALLOWED: dict[str, str] = {}


def _renames(source: str) -> list[int]:
    """The lines of `source` that rename a path or make a temporary file by hand: os.rename,
    os.replace, shutil.move, any `.rename(...)`, a `.replace(target)` of one argument (Path's;
    str.replace takes two, dataclasses.replace keywords), and the tempfile module."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names]
            module = node.module if isinstance(node, ast.ImportFrom) else None
            if "tempfile" in names or module == "tempfile" or \
                    (module in ("os", "shutil") and {"rename", "replace", "move"} & set(names)):
                found.append(node.lineno)
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        name, owner = node.func.attr, node.func.value
        module = owner.id if isinstance(owner, ast.Name) else None
        if (module == "os" and name in ("rename", "replace", "renames")) or \
                (module == "shutil" and name == "move") or \
                (name == "rename" and module != "os") or \
                (name == "replace" and module != "os" and len(node.args) == 1
                 and not node.keywords):
            found.append(node.lineno)
    return sorted(set(found))


def test_paths_are_renamed_only_through_files_py():
    """A temporary file and a rename by hand are written once, in files.py (atomic_write,
    copy_file, publish_dir, move): no other module renames a path or makes a temporary file."""
    found = {str(p.relative_to(REPO)): lines for p in (REPO / "ddpgpt").rglob("*.py")
             if (lines := _renames(p.read_text()))}
    found.pop("ddpgpt/files.py", None)
    assert {p: lines for p, lines in found.items() if p not in RENAMES_ALLOWED} == {}


def test_the_rename_finder_finds_a_rename():
    """The oracle for the test above: every way of renaming is found, str's and dataclasses'
    replace are not."""
    renames = ["os.rename(a, b)", "os.replace(a, b)", "shutil.move(a, b)", "path.rename(b)",
               "Path(a).replace(b)", "tmp.with_suffix('.x').rename(b)", "import tempfile",
               "from os import replace", "from tempfile import mkstemp"]
    for line in renames:
        assert _renames(line) == [1], line
    others = ["name.replace('_', '-')", "dataclasses.replace(cfg, model=m)",
              "dataclasses.replace(cfg, **values)", "text.replace('a', 'b', 1)", "os.remove(a)"]
    assert [line for line in others if _renames(line)] == []


def test_a_package_init_imports_nothing():
    """Callers import from the defining module: a package's __init__ is its docstring (the root's
    also holds __version__), so importing any module of it runs nothing else first."""
    faces = {p.relative_to(REPO): [n.lineno for n in ast.walk(ast.parse(p.read_text()))
                                   if isinstance(n, (ast.Import, ast.ImportFrom))]
             for p in (REPO / "ddpgpt").rglob("__init__.py")}
    assert {p: lines for p, lines in faces.items() if lines} == {}
