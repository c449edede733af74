"""The search API programs are written against: config, paths, `expand`, scoring calls, selection, results.

A program imports what it needs from here (`from sgl_tts.search import ReasoningPath, expand, run_search`) and the
SGLang DSL, nothing else. Names load on first use, so `sgl_tts.search.records` and friends stay importable
without importing SGLang (several seconds).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

_EXPORTS = {
    "sgl_tts.search.api": ("ReasoningPath", "Runtimes", "SearchConfig", "SearchError", "RUNTIME_FAILURES",
                           "append_step", "build_result", "current_step", "expand", "finish", "finish_reason_of",
                           "rank_key", "record_token_confidences", "run_search", "search_failed", "settings_of",
                           "settle_step",
                           "split_steps", "start_search", "step_gen", "top_logprobs_request"),
    "sgl_tts.search.confidence": ("OnlineThreshold", "filter_top", "lowest_group_confidence", "vote_settled",
                                  "weighted_vote"),
    "sgl_tts.search.context": ("SearchContext", "SearchCancelled"),
    "sgl_tts.frontend.sglang_internals": ("as_generated", "wait_meta"),
    "sgl_tts.search.grading": ("answer_at_end", "extract_answer", "normalize_answer"),
    "sgl_tts.search.records": ("Candidate", "SearchResult"),
    "sgl_tts.search.selection": ("select",),
    "sgl_tts.scoring.base": ("aggregate",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)
# old name -> new name, kept working for one release
_RENAMED = {"SearchTracker": "SearchContext", "Path": "ReasoningPath"}


def __getattr__(name: str) -> Any:
    if name in _RENAMED:
        warnings.warn(f"sgl_tts.search.{name} is now {_RENAMED[name]}; the old name goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return __getattr__(_RENAMED[name])
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'sgl_tts.search' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
