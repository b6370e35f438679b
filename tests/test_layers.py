"""Imports point one way: cli, tools, baselines and fleet -> runtime -> codegen -> passes -> compiler -> the bottom.

Every `import fblc...` in the package, at module level or inside a function, is checked against
the layer table of docs/ARCHITECTURE.md section 7; the runtimes see only the bundle format (never
ONNX). A failure names the file, the line and the import, and says which way is allowed.
"""

from __future__ import annotations

import ast
import pathlib

import fblc

PACKAGE = pathlib.Path(fblc.__file__).parent
#: layer -> its rank; a module may import its own layer and any layer of a lower rank
RANKS = {"cli": 5, "tools": 5, "baselines": 5, "fleet": 5, "runtime": 4, "codegen": 3, "passes": 2, "compiler": 1,
         "profiles": 0, "bundle_format": 0, "texel_layout": 0, "errors": 0,
         "paths": 0, "choices": 0}
#: layers that may import only these (besides themselves)
ONLY = {"runtime": {"bundle_format", "texel_layout", "errors", "choices"}}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "fblc" else None


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] if node.module != "fblc" else [f"fblc.{a.name}" for a in node.names]
            found += [(node.lineno, name) for name in names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
    return [(line, name) for line, name in found if name.startswith("fblc.")]


def violations() -> list[str]:
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        own = relative.parts[0].removesuffix(".py") if relative.parts[0] != "__init__.py" else None
        if own not in RANKS:
            continue
        for line, name in _imports(path):
            target = _layer(name)
            if target is None or target == own or target not in RANKS:
                continue
            allowed = ONLY.get(own)
            if (allowed is not None and target not in allowed) or RANKS[target] > RANKS[own]:
                problems.append(f"fblc/{relative}:{line}: {own} imports {name} ({target} is not below {own})")
    return problems


def test_every_fblc_module_belongs_to_a_layer() -> None:
    unknown = sorted({p.relative_to(PACKAGE).parts[0] for p in PACKAGE.rglob("*.py")} - set(RANKS)
                     - {f"{layer}.py" for layer in RANKS} - {"__init__.py", "__main__.py"})
    assert unknown == [], f"add {unknown} to RANKS here and to docs/ARCHITECTURE.md section 7"


def test_imports_point_down() -> None:
    assert violations() == [], "imports against the layer order:\n" + "\n".join(violations())


def test_an_upward_import_is_caught(tmp_path, monkeypatch) -> None:
    """The check itself can fail: a copy of the package with one upward import."""
    import shutil

    copy = tmp_path / "fblc"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    with open(copy / "compiler" / "graph.py", "a", encoding="utf-8") as handle:
        handle.write("\n\ndef _late() -> None:\n    from fblc.codegen.plan import lower  # noqa: F401\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["PACKAGE"]), "PACKAGE", copy)
    assert any("compiler/graph.py" in v and "fblc.codegen.plan" in v for v in violations())
