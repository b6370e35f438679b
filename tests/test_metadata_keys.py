"""Every `fblc.*` metadata key is a constant of fblc/compiler/keys.py: no module spells one as a literal.

A key written twice drifts (a reader looks for `fblc.unused_param` while the pass writes
`fblc.unused_params`); one constant is found by grep and by the editor. The check reads the source
(AST string constants and the literal start of f-strings) and skips strings that name a module
(`"fblc.cli.train"`, the lazy CLI imports) and prose (docstrings, messages: not a bare dotted name).
"""

from __future__ import annotations

import ast
import pathlib
import re

import fblc
from fblc.compiler import keys

PACKAGE = pathlib.Path(fblc.__file__).parent
KEYS_MODULE = PACKAGE / "compiler" / "keys.py"
DOTTED = re.compile(r"fblc(\.[A-Za-z_][A-Za-z0-9_]*)+")


def _names_a_module(text: str, package: pathlib.Path) -> bool:
    parts = text.split(".")[1:]
    for end in range(len(parts), 0, -1):  # "fblc.cli.train" or "fblc.tools.x.function"
        base = package.joinpath(*parts[:end])
        if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
            return True
    return False


def key_literals(package: pathlib.Path = PACKAGE) -> list[str]:
    """`path:line: 'fblc.x'` for every metadata-key literal outside compiler/keys.py."""
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.resolve() == (package / "compiler" / "keys.py").resolve():
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.JoinedStr):
                head = node.values[0] if node.values else None
                if isinstance(head, ast.Constant) and isinstance(head.value, str) and head.value.startswith("fblc."):
                    found.append(f"{path.relative_to(package)}:{node.lineno}: f'{head.value}...'")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and DOTTED.fullmatch(node.value):
                if not _names_a_module(node.value, package):
                    found.append(f"{path.relative_to(package)}:{node.lineno}: '{node.value}'")
    return found


def test_no_metadata_key_literal_outside_keys_py() -> None:
    literals = key_literals()
    assert literals == [], ("metadata keys spelled outside fblc/compiler/keys.py: make each a constant there and "
                            "use keys.NAME:\n" + "\n".join(literals))


def test_the_check_finds_a_literal_key_and_passes_module_names(tmp_path) -> None:
    package = tmp_path / "fblc"
    (package / "cli").mkdir(parents=True)
    (package / "cli" / "__init__.py").write_text('run = "fblc.cli.train"\n', encoding="utf-8")
    (package / "cli" / "train.py").write_text('"""Reads `fblc.kernel`."""\nKEY = "fblc.memory"\n'
                                              'NOTE = f"fblc.adapter.{1}"\n', encoding="utf-8")
    assert key_literals(package) == ["cli/train.py:2: 'fblc.memory'", "cli/train.py:3: f'fblc.adapter....'"]


def test_keys_are_distinct() -> None:
    values = [v for k, v in vars(keys).items() if k.isupper() and isinstance(v, str) and v.startswith("fblc.")]
    assert len(values) == len(set(values)), sorted(v for v in values if values.count(v) > 1)
