"""Where pdtool's data directories are: inside an installed wheel, or in the checkout."""

from __future__ import annotations

from pathlib import Path

_PKG = Path(__file__).resolve().parent


def data_root() -> Path:
    """Folder holding conf/, recipes/ and templates/."""
    installed = _PKG / "_data"
    return installed if (installed / "conf").is_dir() else _PKG.parent


def conf_dir() -> Path:
    return data_root() / "conf"


def recipes_dir() -> Path:
    return data_root() / "recipes"


def templates_dir() -> Path:
    return data_root() / "templates"
