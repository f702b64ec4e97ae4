"""Per-document cost models: what a document costs a DP rank, so the balancer can equalise ranks.

The default is attention plus the linear layers, `alpha * len**2 + beta * len`; a job may name its
own function as "module:function", called with an int64 length array and returning float64 costs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import numpy as np

from msdata_client.choices import is_import_path
from msdata_server._imports import import_callable
from msdata_server.errors import ConfigError

__all__ = ["CostFn", "attention_cost", "check_cost_fn", "load_cost_fn", "make_cost", "priced"]

CostFn = Callable[[np.ndarray], np.ndarray]


def attention_cost(lengths: np.ndarray, *, alpha: float = 1.0, beta: float = 4096.0) -> np.ndarray:
    """alpha*len^2 + beta*len per document, float64 (exact for lengths below 2**26)."""
    x = np.asarray(lengths, dtype=np.float64)
    return alpha * (x * x) + beta * x


def check_cost_fn(path: str) -> str:
    """`path` when it names a function as 'package.module:function' (not importing it); ConfigError otherwise."""
    if not is_import_path(path):
        raise ConfigError(f"cost_fn={path!r} must look like 'package.module:function'")
    return path


def load_cost_fn(path: str) -> CostFn:
    """Import "module:function"; ConfigError naming the path and the fix when it cannot be loaded."""
    module_name, attr = check_cost_fn(path).split(":")
    return import_callable("cost_fn", path, module_name, attr)


def _checked(fn: CostFn, name: str, lengths: np.ndarray) -> np.ndarray:
    """Call a user cost function and insist on one finite, non-negative float64 per length."""
    out = np.asarray(fn(lengths), dtype=np.float64)
    if out.shape != lengths.shape:
        raise ConfigError(
            f"cost_fn {name!r} returned shape {out.shape} for {lengths.shape} lengths; return one cost per length"
        )
    if out.size and not (np.isfinite(out).all() and (out >= 0).all()):
        raise ConfigError(f"cost_fn {name!r} returned a negative or non-finite cost; costs must be finite and >= 0")
    return out


def make_cost(*, alpha: float = 1.0, beta: float = 4096.0, cost_fn: str | None = None) -> CostFn:
    """The cost model of a planner config: a user function when named, else attention_cost."""
    for name, v in (("alpha", alpha), ("beta", beta)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ConfigError(f"{name}={v!r} must be a finite number >= 0")
    if cost_fn is None:
        return partial(attention_cost, alpha=float(alpha), beta=float(beta))
    return partial(_checked, load_cost_fn(cost_fn), cost_fn)


def priced(costs: np.ndarray, lengths: np.ndarray, pad_cost: float) -> np.ndarray:
    """Costs with padding priced: a rank of K tokens costs sum(cost) + pad_cost * (K - sum(len)), which is
    pad_cost * K (the same on every rank) plus the sum of these, `cost - pad_cost * len` (at least 0: a piece
    never costs less than the padding it replaces). pad_cost = 0: the costs themselves."""
    if pad_cost == 0:
        return costs
    return np.maximum(costs - pad_cost * np.asarray(lengths, dtype=np.float64), 0.0)
