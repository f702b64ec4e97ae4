"""Load a user function named "module:function" (transforms, cost functions), with errors that say the fix."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from .errors import ConfigError

__all__ = ["import_callable"]


def import_callable(what: str, path: str, module: str, name: str) -> Callable:
    """``module.name`` as a callable; ConfigError naming ``what``, the path and the fix otherwise."""
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(
            f"{what} {path!r}: cannot import module {module!r} ({e}); is it installed and on sys.path?"
        ) from None
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise ConfigError(f"{what} {path!r}: module {module!r} has no function {name!r}")
    return fn
