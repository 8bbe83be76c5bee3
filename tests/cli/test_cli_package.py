"""The command line is a tool on top of the library: ``trio_debounce._cli`` imports the
library, and the library never imports it (only ``python -m trio_debounce`` does)."""

from __future__ import annotations

import ast
import subprocess
import sys

from tests.harness.env import ROOT

PACKAGE = ROOT / "trio_debounce"


def test_importing_the_library_loads_no_cli_module() -> None:
    code = (
        "import sys, trio_debounce, trio_debounce.abc, trio_debounce.testing\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('trio_debounce._cli'))\n"
        "assert not loaded, loaded\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr


def _imports_cli(path_parts: tuple[str, ...], tree: ast.Module) -> list[int]:
    """Line numbers of the imports of ``trio_debounce._cli`` in a module of the package
    at ``path_parts`` (its path below trio_debounce/)."""
    package = ["trio_debounce", *path_parts[:-1]]
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names = [module, *(f"{module}.{alias.name}" for alias in node.names)]
        else:
            continue
        if any(n == "trio_debounce._cli" or n.startswith("trio_debounce._cli.") for n in names):
            lines.append(node.lineno)
    return lines


def test_no_library_module_imports_the_cli() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).parts
        if parts[0] == "_cli" or parts == ("__main__.py",):
            continue
        for line in _imports_cli(parts, ast.parse(path.read_text(encoding="utf-8"))):
            offenders.append(f"{path.relative_to(ROOT)}:{line}")
    assert offenders == []
    main = ast.parse((PACKAGE / "__main__.py").read_text(encoding="utf-8"))
    assert _imports_cli(("__main__.py",), main)  # the check sees the one import there is
