"""The shipped modules, found the way setuptools finds them: pyproject.toml's
package-dir maps each dynvm.<name> package to its folder (the one mapping)."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def pyproject() -> dict:
    """pyproject.toml, parsed."""
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def package_dirs() -> dict[str, Path]:
    """dynvm.<name> -> its folder."""
    mapping = pyproject()["tool"]["setuptools"]["package-dir"]
    return {name: REPO / folder for name, folder in mapping.items()}


def shipped_modules() -> dict[str, Path]:
    """Every shipped module's dotted name -> its file."""
    modules: dict[str, Path] = {}
    for package, folder in package_dirs().items():
        for path in folder.glob("*.py"):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            modules[name] = path
    return modules
