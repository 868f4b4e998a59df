"""The package logger and a log-once helper (fallback reasons are logged once per process)."""

from __future__ import annotations

import logging

logger = logging.getLogger("hf_accel")
_seen: set[str] = set()


def log_once(key: str, message: str, level: int = logging.INFO) -> None:
    """Log ``message`` at ``level`` the first time ``key`` is seen in this process (not while ``torch.compile``
    traces: a logging call breaks its graph; the same call logs when run outside the compiled region)."""
    if key in _seen or _compiling():
        return
    _seen.add(key)
    logger.log(level, message)


def _compiling() -> bool:
    import sys

    torch = sys.modules.get("torch")  # never imports torch itself (the CLI's argument checks run without it)
    return torch is not None and torch.compiler.is_compiling()
