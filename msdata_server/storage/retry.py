"""Retrying object-store requests: throttling (503 SlowDown, 429), other 5xx, timeouts and connection resets
are retried with exponential backoff and full jitter until ``retries`` or ``give_up_s`` runs out; 403/404 and
anything naming a missing bucket or object fail at once. Nothing here reorders data: a request is retried in
place, its caller waits."""

from __future__ import annotations

import logging
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ..errors import StorageError
from .stats import StorageStats

__all__ = ["Failure", "RetryPolicy", "classify", "with_retries"]

log = logging.getLogger(__name__)
T = TypeVar("T")

_STATUS = re.compile(r"HTTP status (\d{3})")
_THROTTLED = ("SLOW_DOWN", "SLOWDOWN", "THROTTL", "TOO_MANY_REQUESTS", "REQUEST_LIMIT_EXCEEDED", "SERVICE_UNAVAILABLE")
_FATAL = {
    "ACCESS_DENIED": 403,
    "INVALID_ACCESS_KEY_ID": 403,
    "SIGNATURE_DOES_NOT_MATCH": 403,
    "NO_SUCH_BUCKET": 404,
    "NO_SUCH_KEY": 404,
    "RESOURCE_NOT_FOUND": 404,
}


@dataclass(frozen=True, slots=True)
class Failure:
    """What a failed request tells: whether to retry, whether it was throttling, its HTTP status (0: none)."""

    retry: bool
    throttled: bool
    status: int


def classify(e: BaseException) -> Failure:
    """How to treat an exception a filesystem call raised."""
    if isinstance(e, FileNotFoundError):
        return Failure(False, False, 404)
    if isinstance(e, PermissionError):
        return Failure(False, False, 403)
    text = str(e)
    m = _STATUS.search(text)
    status = int(m.group(1)) if m else 0
    upper = text.upper()
    if any(t in upper for t in _THROTTLED) or status in (429, 503):
        return Failure(True, True, status or 503)
    for name, code in _FATAL.items():
        if name in upper:
            return Failure(False, False, status or code)
    if status in (400, 401, 403, 404, 405, 409, 411, 412, 416):
        return Failure(False, False, status)
    if isinstance(e, (OSError, TimeoutError, ConnectionError, EOFError)):
        return Failure(True, False, status)  # 5xx, timeouts, resets, flush failures: transient
    return Failure(False, False, status)


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    retries: int = 100
    give_up_s: float = 600.0
    base_s: float = 0.05
    cap_s: float = 5.0


def with_retries(fn: Callable[[], T], *, what: str, policy: RetryPolicy, stats: StorageStats) -> T:
    """fn(), retried per ``policy``; StorageError naming ``what``, the last status code and the cause when it
    fails for good. ``what`` names the object (never a credential)."""
    t0 = time.monotonic()
    attempt = 0
    while True:
        try:
            return fn()
        except StorageError:
            raise
        except Exception as e:
            if not isinstance(e, (OSError, TimeoutError, ConnectionError, EOFError)):
                raise  # not the store's failure (a file that is not the source's format): the caller's to judge
            f = classify(e)
            if f.throttled:
                stats.add("throttled")
            elapsed = time.monotonic() - t0
            if not f.retry or attempt >= policy.retries or elapsed >= policy.give_up_s:
                stats.add("errors")
                status = f"last status {f.status}" if f.status else "no status code"
                why = "" if not f.retry else f" after {attempt} retries over {elapsed:.1f}s ([storage] give_up_s)"
                raise StorageError(f"{what}: {_cause(e, f.status)} ({status}){why}", status=f.status) from None
            delay = random.uniform(0.0, min(policy.cap_s, policy.base_s * (2**attempt)))  # full jitter
            delay = min(delay, max(0.0, policy.give_up_s - elapsed))
            attempt += 1
            stats.add("retries")
            log.debug("storage: %s failed (%s), retry %d in %.3fs", what, _first_line(e), attempt, delay)
            time.sleep(delay)  # a backoff between retries, not synchronisation


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0][:300] if str(e) else type(e).__name__


def _cause(e: BaseException, status: int) -> str:
    """A short, secret-free cause with the fix where one is known."""
    text = _first_line(e)
    upper = text.upper()
    if status == 403 or "ACCESS_DENIED" in upper or "INVALID_ACCESS_KEY" in upper or "SIGNATURE" in upper:
        return (
            f"access denied ({text}); check the credentials in the environment (AWS_ACCESS_KEY_ID, "
            f"AWS_SECRET_ACCESS_KEY, AWS_PROFILE) or credential files of the server"
        )
    if "NO_SUCH_BUCKET" in upper:
        return f"the bucket does not exist ({text}); fix the bucket name in paths"
    if status == 404 or isinstance(e, FileNotFoundError):
        return f"the object does not exist ({text}); it was deleted, or fix the path"
    if "CURLCODE" in upper or "CONNECT" in upper:
        return f"the endpoint does not answer ({text}); check [storage] s3_endpoint and the network"
    return text
