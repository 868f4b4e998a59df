"""The package logger and a log-once helper (fallback reasons are logged once per process)."""

from __future__ import annotations

import logging

logger = logging.getLogger("hf_accel")
_seen: set[str] = set()


def log_once(key: str, message: str, level: int = logging.INFO) -> None:
    """Log ``message`` at ``level`` the first time ``key`` is seen in this process."""
    if key in _seen:
        return
    _seen.add(key)
    logger.log(level, message)
