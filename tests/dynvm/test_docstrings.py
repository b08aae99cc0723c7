"""Every public top-level class and function of a shipped module has a docstring, and
every named note a comment cites has its header somewhere (docs/ARCHITECTURE.md, Conventions 9)."""

from __future__ import annotations

import ast
import re

from tests.dynvm._shipped import REPO, shipped_modules

# A note's header: its name alone on a line, underlined with ~ (in a docstring or in
# `#` comments).
_HEADER = re.compile(r"^[ \t]*(?:#[ \t]*)?Note \[([^\]]+)\][ \t]*\n[ \t]*(?:#[ \t]*)?~{4,}",
                     re.MULTILINE)
_CITATION = re.compile(r"Note \[([^\]]+)\]")


def _name(cited: str) -> str:
    # A citation may wrap across lines, comment markers included.
    return " ".join(cited.replace("#", " ").split())


def undocumented() -> list[str]:
    """path:line:name of each public top-level def or class without a docstring."""
    found = []
    for path in sorted(shipped_modules().values()):
        for node in ast.parse(path.read_text(), str(path)).body:
            if (isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                    and not node.name.startswith("_") and ast.get_docstring(node) is None):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}:{node.name}")
    return found


def test_public_definitions_have_docstrings():
    missing = undocumented()
    assert not missing, (f"{len(missing)} public top-level definitions without a "
                         "docstring:\n" + "\n".join(missing))


def test_the_scan_sees_public_definitions():
    # A scan that found nothing would pass vacuously.
    total = sum(1 for path in shipped_modules().values()
                for node in ast.parse(path.read_text()).body
                if isinstance(node, ast.FunctionDef | ast.ClassDef)
                and not node.name.startswith("_"))
    assert total > 300


def test_every_cited_note_has_a_header():
    texts = [path.read_text() for path in shipped_modules().values()]
    headers = {_name(name) for text in texts for name in _HEADER.findall(text)}
    cited = {_name(name) for text in texts for name in _CITATION.findall(text)}
    assert "Compile cost estimate" in headers and "Lazy top level" in headers
    assert not cited - headers, f"notes cited but never written: {sorted(cited - headers)}"
