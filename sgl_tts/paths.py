"""Where sgl-tts keeps what it builds at set-up: converted models and the CPU shim library."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The cache root: $SGL_TTS_CACHE, else ~/.cache/sgl-tts."""
    root = os.environ.get("SGL_TTS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "sgl-tts")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path
