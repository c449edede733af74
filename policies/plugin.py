"""SGLang plugin: installs the scheduler policy named by $SGL_TTS_POLICY into the runtime.

SGLang's scheduler process calls `load_plugins()`, which runs `register()` (entry point group
`sglang.srt.plugins`). With SGL_TTS_POLICY=prefix, `register` wraps
`SchedulePolicy.calc_priority` (AROUND hook): SGLang orders the waiting queue as usual (use
`--schedule-policy fcfs`), then our policy reorders it in place. Unset or `fcfs` installs nothing.
With `--enable-priority-scheduling` the queue is then stably re-sorted by priority, so request
priorities (and SGLang's priority preemption) still win and our order holds within each priority.
SGL_TTS_POLICY_TRACE=<file> appends each reordered queue's rids as a JSON line (for tests).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Callable

from policies import make_policy
from policies.base import BeamTag, FcfsOrder, OrderingPolicy, decode_rid

ENV_POLICY = "SGL_TTS_POLICY"
ENV_TRACE = "SGL_TTS_POLICY_TRACE"
TARGET = "sglang.srt.managers.schedule_policy.SchedulePolicy.calc_priority"

logger = logging.getLogger(__name__)


def tag_of_request(req: Any) -> BeamTag | None:
    """The tag carried by a scheduler `Req` (in its rid), or None."""
    return decode_rid(getattr(req, "rid", None))


def make_calc_priority_hook(policy: OrderingPolicy, trace_path: str | None = None) -> Callable[..., Any]:
    """An AROUND hook for `SchedulePolicy.calc_priority(self, waiting_queue, running_batch, ...)`."""

    def calc_priority(original: Callable[..., Any], schedule_policy: Any, waiting_queue: list, *args: Any,
                      **kwargs: Any) -> Any:
        result = original(schedule_policy, waiting_queue, *args, **kwargs)
        if len(waiting_queue) > 1:
            waiting_queue[:] = policy.order(waiting_queue, tag_of_request)
            if getattr(schedule_policy, "enable_priority_scheduling", False):
                sign = schedule_policy.priority_sign
                waiting_queue.sort(key=lambda r: (r.priority or 0) * sign)
            if trace_path:
                with open(trace_path, "a") as f:
                    f.write(json.dumps({"pid": os.getpid(), "rids": [r.rid for r in waiting_queue]}) + "\n")
        return result

    return calc_priority


def install(name: str, registry: Any, around: Any, trace_path: str | None = None) -> OrderingPolicy | None:
    """Register the hook for policy `name` with `registry` (SGLang's HookRegistry); None for FCFS."""
    policy = make_policy(name)
    if isinstance(policy, FcfsOrder):
        return None
    registry.register(TARGET, make_calc_priority_hook(policy, trace_path), around)
    logger.info("sgl-tts: scheduler policy %r installed on %s", name, TARGET)
    return policy


def register() -> None:
    """The `sglang.srt.plugins` entry point."""
    name = os.environ.get(ENV_POLICY, "").strip() or FcfsOrder.name
    if name == FcfsOrder.name:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    install(name, HookRegistry, HookType.AROUND, os.environ.get(ENV_TRACE) or None)
