"""Optional dependencies: a package that only some paths need, asked for by name.

Every third-party import in shardwise/ is either a base dependency (pyproject.toml's
``dependencies``) or reached only through :func:`require` or a ``try: import ... except
ImportError`` guard, so a missing extra ends in one line that names what to install, never in a
traceback after training (``tests/foundation/test_dependencies.py`` keeps this true).
"""
from __future__ import annotations

import importlib
import importlib.util

from shardwise.config import ConfigError


def available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def require(module: str, extra: str, setting: str):
    """Import ``module`` or raise a ConfigError naming the extra that provides it."""
    if not available(module):
        raise ConfigError(setting, True, f"needs the '{module}' package, which is not installed",
                          f"pip install 'shardwise[{extra}]'")
    return importlib.import_module(module)
