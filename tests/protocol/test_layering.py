"""client/ and server/ do not import each other; both build on floe.protocol."""

from __future__ import annotations

import ast
from pathlib import Path

import floe

SRC = Path(floe.__file__).parent
CLIENT_NAMES = {"Client", "AsyncClient", "connect", "connect_async"}


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports (`from floe import Client` counts as floe.client)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            if node.module == "floe" and {a.name for a in node.names} & CLIENT_NAMES:
                found.add("floe.client")
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def offenders(package: str, forbidden: str) -> list[str]:
    return [
        f"{path.relative_to(SRC.parent)} imports {module}"
        for path in sorted((SRC / package).rglob("*.py"))
        for module in sorted(imported_modules(path))
        if module == forbidden or module.startswith(forbidden + ".")
    ]


def test_client_does_not_import_server() -> None:
    assert offenders("client", "floe.server") == []


def test_server_does_not_import_client() -> None:
    assert offenders("server", "floe.client") == []


def test_the_check_sees_an_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("from floe.server import wire\nfrom floe import connect\n")
    assert {"floe.server", "floe.server.wire", "floe.client"} <= imported_modules(bad)
