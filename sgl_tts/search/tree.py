"""The search tree one search grew, as the verifier saw it: each scored step a node with its score.

`SearchContext.score` adds every path it scores; a child's steps extend its parent's, so each step prefix is one
node. When the search config asks for it (`record_tree`), the result carries the tree (`extra["tree"]`):
nodes with their parent, depth, step text, score, the speculative head start the step began with (FastTTS),
and for the paths that ended, how they ended and whether their answer is the selected one.
`sgl_tts.app.tree_plot` draws it.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence


class SearchTree:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: dict[tuple[str, ...], int] = {}
        self.nodes: list[dict[str, Any]] = []

    def _node(self, steps: tuple[str, ...]) -> dict[str, Any]:
        node_id = self._ids.get(steps)
        if node_id is None:
            parent = self._node(steps[:-1])["id"] if len(steps) > 1 else None
            node_id = self._ids[steps] = len(self.nodes)
            self.nodes.append({"id": node_id, "parent": parent, "depth": len(steps), "step": steps[-1],
                               "score": None, "head_start": 0})
        return self.nodes[node_id]

    def add(self, steps: Sequence[str], scores: Sequence[float], head_start: int = 0) -> None:
        """A scored path: one node per step prefix; the last step's head start (speculative tokens)."""
        if not steps:
            return
        with self._lock:
            for depth in range(1, len(steps) + 1):
                node = self._node(tuple(steps[:depth]))
                if depth <= len(scores):
                    node["score"] = scores[depth - 1]
            if head_start:
                self._node(tuple(steps))["head_start"] = head_start

    def export(self, ended: Sequence[tuple[Sequence[str], str, bool]]) -> dict[str, Any]:
        """The tree as data; `ended` lists (steps, finish reason, selected) of the result's candidates."""
        with self._lock:
            nodes = [dict(node) for node in self.nodes]
            for steps, reason, selected in ended:
                node_id = self._ids.get(tuple(steps))
                if node_id is not None:
                    nodes[node_id].update(end=reason, selected=selected)
        return {"nodes": nodes}
