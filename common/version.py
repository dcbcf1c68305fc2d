"""Iris's version, as installed (`iris --version`, the ready banner, `/version`)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def iris_version() -> str:
    """The installed distribution's version; "unknown" when run from an uninstalled tree."""
    try:
        return version("iris-serve")
    except PackageNotFoundError:
        return "unknown"
