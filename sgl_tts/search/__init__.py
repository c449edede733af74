"""The search API programs are written against: config, paths, `expand`, scoring calls, selection, results.

A program imports what it needs from here (`from sgl_tts.search import Path, expand, run_search`) and the
SGLang DSL, nothing else. Names load on first use, so `sgl_tts.search.records` and friends stay importable
without importing SGLang (several seconds).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "sgl_tts.search.api": ("Path", "Runtimes", "SearchConfig", "SearchTracker", "SearchError", "RUNTIME_FAILURES",
                           "append_step", "build_result", "expand", "finish", "finish_reason_of", "rank_key",
                           "run_search", "search_failed", "split_steps", "start_search", "step_gen"),
    "sgl_tts.frontend.sglang_internals": ("wait_meta",),
    "sgl_tts.search.grading": ("extract_answer",),
    "sgl_tts.search.records": ("Candidate", "SearchResult"),
    "sgl_tts.search.selection": ("select",),
    "sgl_tts.scoring.base": ("aggregate",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'sgl_tts.search' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
