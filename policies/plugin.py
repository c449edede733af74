"""SGLang plugin: installs the scheduler policy named by $SGLTTS_POLICY into the runtime, and (CPU runtimes) the
batched decode attention of policies/cpu_attention.py ($SGLTTS_CPU_ATTENTION=batched), the packed linear layers of
policies/cpu_linear.py ($SGLTTS_CPU_LINEAR=packed), the compiled RMSNorm and rotary embedding of policies/cpu_layers.py
($SGLTTS_CPU_LAYERS=fused), the lean Llama decode step over those kernels of policies/lean_decode.py
($SGLTTS_CPU_DECODE=lean), the inverse-CDF sampling of policies/cpu_sampling.py
($SGLTTS_CPU_SAMPLING=cdf), denormals flushed to zero in the scheduler's thread ($SGLTTS_CPU_DENORMALS=flush),
large blocks kept in the scheduler's heap for reuse (policies/cpu_malloc.py, $SGLTTS_CPU_MALLOC=reuse),
the search placement over data-parallel ranks of policies/search_placement.py
($SGLTTS_DP_PLACEMENT=search), an idle rank's core lent to a working one (policies/core_lending.py,
$SGLTTS_CORE_LENDING=on), the probe margins of policies/probe_readout.py ($SGLTTS_PROBE_HEAD=<head file>)
and the step timing of
policies/step_timing.py ($SGLTTS_STEP_TRACE=<file>). Each installed hook says so in one line of the server's log.

SGLang's scheduler process calls `load_plugins()`, which runs `register()` (entry point group
`sglang.srt.plugins`). With SGLTTS_POLICY=prefix, `register` wraps
`SchedulePolicy.calc_priority` (AROUND hook): SGLang orders the waiting queue as usual (use
`--schedule-policy fcfs`), then our policy reorders it in place. Unset or `fcfs` installs nothing.
With `--enable-priority-scheduling` the queue is then stably re-sorted by priority, so request
priorities (and SGLang's priority preemption) still win and our order holds within each priority.
SGLTTS_POLICY_TRACE=<file> appends each reordered queue's rids as a JSON line (for tests).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable

from policies import (core_lending, cpu_attention, cpu_layers, cpu_linear, cpu_malloc, cpu_sampling, idle_wait,
                      lean_decode, make_policy, probe_readout, search_placement, step_timing)
from policies.base import BeamTag, FcfsOrder, OrderingPolicy, decode_rid
from policies.step_timing import StepTrace
from sgl_tts import env_names

ENV_POLICY = env_names.POLICY
ENV_TRACE = env_names.POLICY_TRACE
TARGET = "sglang.srt.managers.schedule_policy.SchedulePolicy.calc_priority"



def announce(what: str) -> None:
    """One line in the server's log (stderr: SGLang configures its logging only after the plugins load)."""
    print(f"sgl-tts plugin (pid {os.getpid()}): {what}", file=sys.stderr, flush=True)


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
    announce(f"scheduler policy {name!r} installed on {TARGET}")
    return policy


def register() -> None:
    """The `sglang.srt.plugins` entry point: the scheduler policy named by $SGLTTS_POLICY, the paged or batched
    CPU decode attention (policies/cpu_attention.py) when $SGLTTS_CPU_ATTENTION says so, the packed linear layers
    (policies/cpu_linear.py) when $SGLTTS_CPU_LINEAR says so, the compiled norms and rotary embedding
    (policies/cpu_layers.py) when $SGLTTS_CPU_LAYERS says so, the lean decode step (policies/lean_decode.py) when
    $SGLTTS_CPU_DECODE says so and those three kernels are installed, the inverse-CDF sampling
    (policies/cpu_sampling.py) when $SGLTTS_CPU_SAMPLING says so, the search placement (policies/search_placement.py)
    when $SGLTTS_DP_PLACEMENT says so, the core lending (policies/core_lending.py) when $SGLTTS_CORE_LENDING says so,
    the probe margins (policies/probe_readout.py) when $SGLTTS_PROBE_HEAD names a head file, and the step timing
    (policies/step_timing.py) when $SGLTTS_STEP_TRACE names a file."""
    name = (env_names.read(ENV_POLICY) or "").strip() or FcfsOrder.name
    attention = (env_names.read(env_names.CPU_ATTENTION) or "").strip()
    linear = (env_names.read(env_names.CPU_LINEAR) or "").strip()
    sampling = (env_names.read(env_names.CPU_SAMPLING) or "").strip()
    placement = (env_names.read(env_names.DP_PLACEMENT) or "").strip()
    probe_head = env_names.read(env_names.PROBE_HEAD)
    step_trace = env_names.read(env_names.STEP_TRACE)
    switched_on: list[tuple[list[tuple[str, Any, str]], str]] = []  # (target, hook, hook kind)s, announcement
    if attention in cpu_attention.VALUES:
        hooks = [(cpu_attention.TARGET, cpu_attention.make_decode_hook(cpu_attention.DECODE[attention]), "AROUND"),
                 (idle_wait.TARGET, idle_wait.event_loop, "REPLACE")]
        if attention == cpu_attention.PAGED:
            hooks.append((cpu_attention.EXTEND_TARGET, cpu_attention.extend_hook, "AROUND"))
        targets = ", ".join(target for target, _, _ in hooks if target != idle_wait.TARGET)
        switched_on.append((hooks, f"{attention} attention installed on {targets}; {idle_wait.TARGET} waits for "
                                   f"requests"))
    if linear in cpu_linear.VALUES:
        linear_hook, head_hook = cpu_linear.hooks_for(linear)
        if linear in cpu_linear.FOUR_BIT:
            cpu_linear.tell_grid_read(announce)
        switched_on.append(([(cpu_linear.LINEAR_TARGET, linear_hook, "AROUND"),
                             (cpu_linear.LM_HEAD_TARGET, head_hook, "AROUND"),
                             (cpu_linear.NORMALIZER_TARGET, cpu_linear.normalizer_hook, "AROUND")],
                            f"{linear} linear layers installed on {cpu_linear.LINEAR_TARGET} and "
                            f"{cpu_linear.LM_HEAD_TARGET}, live-rows normalizer on {cpu_linear.NORMALIZER_TARGET}"))
    if (env_names.read(env_names.CPU_LAYERS) or "").strip() == cpu_layers.FUSED:
        switched_on.append(([(cpu_layers.NORM_TARGET, cpu_layers.norm_hook, "AROUND"),
                             (cpu_layers.ROTARY_TARGET, cpu_layers.rotary_hook, "AROUND")],
                            f"compiled RMSNorm and rotary embedding installed on {cpu_layers.NORM_TARGET} and "
                            f"{cpu_layers.ROTARY_TARGET}"))
    decode = (env_names.read(env_names.CPU_DECODE) or "").strip()
    if decode in lean_decode.VALUES:
        kernels = {env_names.CPU_ATTENTION: attention == cpu_attention.PAGED,
                   env_names.CPU_LINEAR: linear in cpu_linear.VALUES,
                   env_names.CPU_LAYERS: (env_names.read(env_names.CPU_LAYERS) or "").strip() == cpu_layers.FUSED}
        if all(kernels.values()):
            hook = lean_decode.make_forward_hook(bf16=linear in cpu_linear.BF16, grids=linear in cpu_linear.FOUR_BIT,
                                                 compiled=decode == lean_decode.LEAN, announce=announce)
            switched_on.append(([(lean_decode.TARGET, hook, "AROUND")],
                                f"lean decode ({decode}) installed on {lean_decode.TARGET}"))
        else:
            announce(f"lean decode not installed: it computes with the kernels of "
                     f"{', '.join(name for name, on in kernels.items() if not on)}, which are not installed")
    if sampling == cpu_sampling.CDF:
        switched_on.append(([(cpu_sampling.TARGET, cpu_sampling.sampling_hook, "AROUND"),
                             (cpu_sampling.FILTERED_TARGET, cpu_sampling.split_hook, "AROUND"),
                             (cpu_sampling.SAMPLER_TARGET, cpu_sampling.sampler_hook, "AROUND"),
                             (cpu_sampling.SOFTMAX_TARGET, cpu_sampling.softmax_hook, "AROUND")],
                            f"inverse-CDF sampling installed on {cpu_sampling.TARGET} and, per row, on "
                            f"{cpu_sampling.FILTERED_TARGET}; the sampler's softmax in place on "
                            f"{cpu_sampling.SOFTMAX_TARGET} inside {cpu_sampling.SAMPLER_TARGET}"))
    if (env_names.read(env_names.CPU_DENORMALS) or "").strip() == cpu_sampling.FLUSH:
        # this thread runs the scheduler's forward and sampling; FTZ/DAZ are per thread
        announce(f"denormals {'' if cpu_sampling.flush_denormals() else 'not '}flushed to zero in this thread")
    if (env_names.read(env_names.CPU_MALLOC) or "").strip() == cpu_malloc.REUSE:
        # process-wide, and inherited by the data-parallel ranks forked after this
        announce(f"large blocks {'' if cpu_malloc.reuse_large_blocks() else 'not '}kept in the heap for reuse")
    if placement == search_placement.SEARCH:
        switched_on.append(([(search_placement.TARGET, search_placement.make_dispatch_hook(), "AROUND")],
                            f"search placement installed on {search_placement.TARGET}"))
    lending = (env_names.read(env_names.CORE_LENDING) or "").strip()
    if lending in (core_lending.ON, core_lending.ALWAYS):
        # made here, before SGLang forks the ranks, so that they share its board (the watch each rank reads with
        # is its own copy, forked before its first reading)
        watch = core_lending.OthersWatch() if lending == core_lending.ON else None
        switched_on.append(([(core_lending.TARGET, core_lending.CoreLending(watch=watch).forward, "AROUND")],
                            f"core lending installed on {core_lending.TARGET}"
                            + ("" if watch else " (whatever the other processes do)")))
    if probe_head:
        switched_on.append(([(probe_readout.TARGET, probe_readout.make_forward_hook(probe_head), "AROUND")],
                            f"probe margins of {probe_head} installed on {probe_readout.TARGET}"))
    if step_trace:
        trace = StepTrace(step_trace)
        switched_on.append(([(step_timing.RUN_BATCH, trace.run_batch, "AROUND"),
                             (step_timing.MODEL_FORWARD, trace.model_forward, "AROUND")],
                            f"step timing to {step_trace}"))
    if name == FcfsOrder.name and not switched_on:
        return  # nothing to install: SGLang's hook registry is not even imported
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for hooks, announcement in switched_on:
        for target, hook, kind in hooks:
            HookRegistry.register(target, hook, HookType[kind])
        announce(announcement)
    if name != FcfsOrder.name:
        install(name, HookRegistry, HookType.AROUND, env_names.read(ENV_TRACE))
