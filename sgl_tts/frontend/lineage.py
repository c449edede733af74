"""Request lineage from SGLang's own fork tree, for any program.

Every program state gets a `Node` the first time it sends a request (its first `gen`, or the prefix
pre-send SGLang makes when it forks a state): a program's first state starts a new run, and a state made by
`fork` is a child of the state it was forked from (the parent's node rides into the child through the
executor variables that `fork` copies). The node becomes the request's `BeamTag`:

    problem_id = the run's id       iteration = depth in the fork tree
    beam_id    = the node's number  parent_id = the parent node's number (None at the root)

Numbers count up per run in the order states first send, and a parent always sends (or is pre-sent) before
its children, so parent ids follow the tree: `PrefixAwareOrder` groups the forks of one parent and keeps
subtrees contiguous (docs/policies.md), for a plain `@sgl.function` exactly as for a built-in program.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

from policies.base import BeamTag, encode_rid
from sgl_tts.frontend.sglang_internals import executor_of, inherited_node, own_node, set_own_node


@dataclass
class Run:
    """One program run: its id and the counter that numbers its nodes."""

    run_id: str
    numbers: Any = field(default_factory=itertools.count)


@dataclass(frozen=True)
class Node:
    run: Run = field(compare=False)
    number: int
    parent: int | None
    depth: int

    def tag(self) -> BeamTag:
        return BeamTag(self.run.run_id, self.depth, self.number, self.parent)

    def speculative_tag(self, priority_bin: int) -> BeamTag:
        """The tag of a speculative continuation of this node's text: one step deeper, a child of this node."""
        return BeamTag(self.run.run_id, self.depth + 1, next(self.run.numbers), self.number, True, priority_bin)


_lock = threading.Lock()


def node_of(state: Any, run_label: str = "run") -> Node:
    """The lineage node of a program state (or executor), made on first use."""
    executor = executor_of(state)
    with _lock:
        node = own_node(executor)
        if node is None:
            parent = inherited_node(executor)
            if parent is None:
                run = Run(f"{run_label}/{uuid.uuid4().hex[:8]}")
                node = Node(run, next(run.numbers), None, 0)
            else:
                node = Node(parent.run, next(parent.run.numbers), parent.number, parent.depth + 1)
            set_own_node(executor, node)
        return node


def rid_of(state: Any, run_label: str = "run") -> str:
    """A fresh request id carrying the state's lineage tag (one per request: SGLang needs unique rids)."""
    return encode_rid(node_of(state, run_label).tag())
