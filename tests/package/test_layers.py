"""The package's layers: imports go one way, no cycles, and modules stay small.

The layers are stated once, in ``LAYERS`` below (and drawn in ``docs/design.rst``). A
module may import modules of its own layer or of lower ones, never of a higher one;
``TYPE_CHECKING`` imports count too (a cycle at the type level is still a cycle). The
public ``trio_debounce.abc`` imports only the contracts and the values below them.

Sizes follow the guide of the design: no module much beyond 600 lines of code and no
class much beyond 400 (lines of code: not blank, not a comment, not a docstring). The
few that are still past it are listed in ``OVERSIZED`` with their size today, as
ceilings: they may shrink, never grow, and leave the list when they are within the guide.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

from tests.harness.env import ROOT

PACKAGE = ROOT / "trio_debounce"

#: Values and pure helpers: no Trio task, no I/O of their own.
VALUES = 0
#: The window engine: every rule of one window, pure.
ENGINE = 1
#: The contracts between the coordinator and its stores and backends.
CONTRACTS = 2
#: The backends and stores behind the contracts, and the testing fakes built on them.
BACKENDS = 3
#: The coordinator's parts: local windows, shared windows, the deferred runs.
PARTS = 4
#: The public facade.
FACADE = 5
#: The public packages and the command-line tools (never imported by the library).
TOP = 6

LAYERS: dict[str, int] = {
    "_types": VALUES,
    "_errors": VALUES,
    "_validate": VALUES,
    "_wallclock": VALUES,
    "_keys": VALUES,
    "_payload": VALUES,
    "_invoke": VALUES,
    "_util": VALUES,
    "_version": VALUES,
    "_options": VALUES,
    "_process": VALUES,
    "_codec": VALUES,
    "_events": VALUES,
    "_engine": ENGINE,
    "_flow": ENGINE,  # the engine's flow-control half
    "_backend": CONTRACTS,
    "_kv": CONTRACTS,
    "_runs._store": CONTRACTS,
    "_runs._types": CONTRACTS,
    "_protocol": BACKENDS,
    "_runs._kv_store": BACKENDS,
    "_runs._sqlite_rows": BACKENDS,
    "_runs._sqlite": BACKENDS,
    "_protocol._housekeeping": BACKENDS,
    "_protocol._control": BACKENDS,
    "_protocol._register": BACKENDS,
    "_protocol._answers": BACKENDS,
    "_protocol._turns": BACKENDS,
    "_protocol._records": BACKENDS,
    "_protocol._finalize": BACKENDS,
    "_protocol._leases": BACKENDS,
    "_protocol._view": BACKENDS,
    "_protocol._documents": BACKENDS,
    "_protocol._rules": BACKENDS,
    "_protocol._flow_rules": BACKENDS,
    "_protocol._backend": BACKENDS,
    "_protocol._inspect": BACKENDS,
    "_protocol._watch": BACKENDS,
    "nats": BACKENDS,
    "otel": PARTS,  # events in, OpenTelemetry out
    "testing._memory": BACKENDS,
    "testing._conformance": BACKENDS,
    "testing._run_conformance": BACKENDS,
    "testing._nats_server": VALUES,  # the standard library only
    "_window": PARTS,
    "_firing": PARTS,
    "_local": PARTS,
    "_flow_local": PARTS,
    "_flow_api": PARTS,
    "_shared_window": PARTS,
    "_shared": PARTS,
    "_upkeep": PARTS,
    "_runs": PARTS,  # the scheduler's parts and its package
    "_runs._steer": PARTS,  # an operator's cancel and retry, on the store alone
    "_coordinator": FACADE,
    "": TOP,  # trio_debounce/__init__.py
    "__main__": TOP,
    "abc": TOP,
    "testing": TOP,  # trio_debounce/testing/__init__.py
    # The fixtures' objects (they open coordinators) and the pytest plugin.
    "testing._fixtures": TOP,
    "testing._pytest_plugin": TOP,
    "_cli": TOP,
    "_cli._runs": TOP,
}

#: Upward imports still to remove, as (importer, imported).
KNOWN_UPWARD: set[tuple[str, str]] = set()

#: Modules (by dotted name under the package) and classes ("module:Class") still past
#: the size guide, with their lines of code today as a ceiling.
OVERSIZED: dict[str, int] = {}

MODULE_GUIDE = 600
CLASS_GUIDE = 400


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _layer(module: str) -> int:
    """The layer of a module: its own entry, else its top-level package's."""
    if module in LAYERS:
        return LAYERS[module]
    top = module.split(".")[0]
    if top in LAYERS:
        return LAYERS[top]
    raise AssertionError(f"trio_debounce.{module} has no layer: add it to LAYERS")


def _imports(module: str, path: Path) -> set[str]:
    """The package modules ``module`` imports (relative or absolute)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_package = path.name == "__init__.py"
    here = module.split(".") if module else []
    package = here if is_package else here[:-1]
    found: set[str] = set()
    known = set(_modules())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = [*base, *(node.module.split(".") if node.module else [])]
            elif node.module and node.module.split(".")[0] == "trio_debounce":
                target = node.module.split(".")[1:]
            else:
                continue
            name = ".".join(target)
            # "from . import _engine" names a module; "from ._x import y" an attribute.
            for alias in node.names:
                sub = ".".join([*target, alias.name])
                if sub in known:
                    found.add(sub)
                elif name in known:
                    found.add(name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "trio_debounce":
                    found.add(".".join(parts[1:]))
    found.discard(module)
    return found


def _graph() -> dict[str, set[str]]:
    return {module: _imports(module, path) for module, path in _modules().items()}


def test_every_module_has_a_layer() -> None:
    modules = _modules()
    for module in modules:
        _layer(module)
    tops = {module.split(".")[0] for module in modules}
    assert not set(LAYERS) - set(modules) - tops, "LAYERS names modules that are gone"


def test_imports_go_one_way() -> None:
    upward = set()
    for module, deps in _graph().items():
        for dep in deps:
            if _layer(dep) > _layer(module):
                upward.add((module, dep))
    assert upward <= KNOWN_UPWARD, f"upward imports: {sorted(upward - KNOWN_UPWARD)}"
    assert upward >= KNOWN_UPWARD, f"fixed, remove from KNOWN_UPWARD: {KNOWN_UPWARD - upward}"


def test_no_import_cycles() -> None:
    graph = _graph()
    allowed = KNOWN_UPWARD
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for dep in sorted(graph.get(module, ())):
            if (module, dep) in allowed:
                continue
            if state.get(dep) == 1:
                cycle = [*stack[stack.index(dep) :], dep]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if dep not in state:
                visit(dep)
        stack.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_the_public_abc_imports_only_contracts_and_values() -> None:
    deps = _graph()["abc"]
    assert deps, "abc re-exports the contracts"
    assert all(_layer(dep) <= CONTRACTS for dep in deps), deps


def test_the_library_never_imports_the_tools() -> None:
    tools = {"_cli", "__main__"}
    for module, deps in _graph().items():
        if _layer(module) < TOP:
            assert not {d.split(".")[0] for d in deps} & tools, (module, deps)


#: The protocol's pure modules: they decide on documents as read, so they import no
#: Trio (nor anything that does I/O) and none of the protocol's stateful parts.
PURE_PROTOCOL = ("_protocol._documents", "_protocol._rules", "_protocol._flow_rules")
PROTOCOL_PARTS = {
    "_protocol._view",
    "_protocol._leases",
    "_protocol._turns",
    "_protocol._records",
    "_protocol._finalize",
    "_protocol._register",
    "_protocol._answers",
    "_protocol._housekeeping",
    "_protocol._control",
    "_protocol._inspect",
    "_protocol._watch",
    "_protocol._backend",
}


@pytest.mark.parametrize("module", PURE_PROTOCOL)
def test_the_protocol_rules_are_pure(module: str) -> None:
    path = _modules()[module]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    outside = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        node.module.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and not node.level and node.module
    }
    assert not outside & {"trio", "asyncio", "socket", "sqlite3"}, (module, outside)
    assert not _imports(module, path) & PROTOCOL_PARTS, module


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                first = body[0]
                lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return lines


def code_lines(source: str) -> set[int]:
    """The line numbers of ``source`` that hold code: not blank, not only a comment,
    not part of a docstring."""
    tree = ast.parse(source)
    docs = _docstring_lines(tree)
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in (
            tokenize.COMMENT,
            tokenize.NL,
            tokenize.NEWLINE,
            tokenize.INDENT,
            tokenize.DEDENT,
            tokenize.ENDMARKER,
        ):
            continue
        for line in range(token.start[0], token.end[0] + 1):
            if line not in docs:
                lines.add(line)
    return lines


def _sizes() -> dict[str, int]:
    sizes: dict[str, int] = {}
    for module, path in _modules().items():
        source = path.read_text(encoding="utf-8")
        code = code_lines(source)
        sizes[module] = len(code)
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                span = range(node.lineno, (node.end_lineno or node.lineno) + 1)
                sizes[f"{module}:{node.name}"] = len(code.intersection(span))
    return sizes


def test_code_lines_counts_code_only() -> None:
    source = (
        '"""Doc\nstring."""\n\n# a comment\nx = 1  # trailing\n\n\n'
        'def f():\n    """One."""\n    return (\n        x\n    )\n'
    )
    assert sorted(code_lines(source)) == [5, 8, 10, 11, 12]


@pytest.mark.parametrize("kind", ["module", "class"])
def test_modules_and_classes_stay_within_the_guide(kind: str) -> None:
    sizes = _sizes()
    guide = CLASS_GUIDE if kind == "class" else MODULE_GUIDE
    over = {
        name: size
        for name, size in sizes.items()
        if (":" in name) == (kind == "class") and size > guide * 1.1
    }
    unlisted = {name: size for name, size in over.items() if name not in OVERSIZED}
    assert not unlisted, f"past the {guide}-line guide: {unlisted}"
    grown = {name: (size, OVERSIZED[name]) for name, size in over.items() if size > OVERSIZED[name]}
    assert not grown, f"grew past their ceiling (size, ceiling): {grown}"
    done = {
        name
        for name in OVERSIZED
        if (":" in name) == (kind == "class") and sizes.get(name, 0) <= guide * 1.1
    }
    assert not done, f"now within the guide, remove from OVERSIZED: {sorted(done)}"
