"""The SGLang plugin: the hook on fake scheduler objects, its registration, and its fit with the
installed SGLang (read from source, without starting a runtime)."""

import ast
import importlib.util
import json
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from policies import PrefixAwareOrder
from policies import plugin
from policies.base import BeamTag, encode_rid
from sgl_tts import env_names

ROOT = Path(__file__).resolve().parents[1]


class FakeReq:
    def __init__(self, rid, priority=None):
        self.rid = rid
        self.priority = priority

    def __repr__(self):
        return f"FakeReq({self.rid!r}, {self.priority})"


class FakeSchedulePolicy:
    """Shaped like sglang's SchedulePolicy as the hook sees it."""

    def __init__(self, enable_priority_scheduling=False, priority_sign=-1):
        self.enable_priority_scheduling = enable_priority_scheduling
        self.priority_sign = priority_sign
        self.calls = []

    def calc_priority(self, waiting_queue, running_batch=None, processed_tokens=0):
        self.calls.append((len(waiting_queue), running_batch, processed_tokens))


def tagged(iteration, beam, parent, problem="p", priority=None, speculative=False, bin_index=0):
    return FakeReq(encode_rid(BeamTag(problem, iteration, beam, parent, speculative, bin_index)), priority)


def shuffled_forks():
    # Children of parents 2, 0, 1 arriving interleaved, plus an untagged request.
    reqs = [tagged(1, b, p) for b, p in [(0, 2), (1, 0), (2, 1), (3, 2), (4, 0), (5, 1)]]
    return reqs[:3] + [FakeReq("plain")] + reqs[3:]


def parents(queue):
    return [plugin.tag_of_request(r).parent_id if plugin.tag_of_request(r) else "u" for r in queue]


def test_hook_calls_sglang_first_then_reorders_the_same_list_in_place():
    hook = plugin.make_calc_priority_hook(PrefixAwareOrder())
    sched = FakeSchedulePolicy()
    queue = shuffled_forks()
    same = queue
    hook(FakeSchedulePolicy.calc_priority, sched, queue, "running", processed_tokens=7)
    assert sched.calls == [(7, "running", 7)]
    assert queue is same
    assert parents(queue) == [0, 0, 1, 1, 2, 2, "u"]


def test_with_priority_scheduling_priorities_win_and_our_order_holds_within_them():
    hook = plugin.make_calc_priority_hook(PrefixAwareOrder())
    queue = [tagged(1, b, p, priority=prio) for b, p, prio in
             [(0, 1, 0), (1, 0, 0), (2, 1, 10), (3, 0, 10), (4, 2, 10)]]
    # SGLang's default: larger priority values first (priority_sign = -1).
    hook(FakeSchedulePolicy.calc_priority, FakeSchedulePolicy(True, -1), queue)
    assert [(r.priority, plugin.tag_of_request(r).parent_id) for r in queue] == [
        (10, 0), (10, 1), (10, 2), (0, 0), (0, 1)]


def test_trace_file_records_each_reordered_queue(tmp_path):
    trace = tmp_path / "trace.jsonl"
    hook = plugin.make_calc_priority_hook(PrefixAwareOrder(), str(trace))
    queue = shuffled_forks()
    hook(FakeSchedulePolicy.calc_priority, FakeSchedulePolicy(), queue)
    hook(FakeSchedulePolicy.calc_priority, FakeSchedulePolicy(), queue[:1])
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(lines) == 1 and lines[0]["rids"] == [r.rid for r in queue]


class FakeRegistry:
    def __init__(self):
        self.registered = []

    def register(self, target, hook, hook_type):
        self.registered.append((target, hook, hook_type))


def test_install_registers_an_around_hook_for_prefix_only():
    registry = FakeRegistry()
    assert plugin.install("fcfs", registry, "AROUND") is None
    assert registry.registered == []
    assert isinstance(plugin.install("prefix", registry, "AROUND"), PrefixAwareOrder)
    [(target, hook, hook_type)] = registry.registered
    assert target == "sglang.srt.managers.schedule_policy.SchedulePolicy.calc_priority"
    assert hook_type == "AROUND" and callable(hook)
    with pytest.raises(KeyError, match="unknown scheduler policy .*; known: fcfs, prefix"):
        plugin.install("lpm", registry, "AROUND")


def test_register_without_the_env_var_installs_nothing(monkeypatch):
    monkeypatch.delenv(plugin.ENV_POLICY, raising=False)
    assert plugin.register() is None
    monkeypatch.setenv(plugin.ENV_POLICY, "fcfs")
    assert plugin.register() is None


def test_entry_point_names_register():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    group = project["project"]["entry-points"]["sglang.srt.plugins"]
    [(name, value)] = group.items()
    assert EntryPoint(name, value, "sglang.srt.plugins").load() is plugin.register


def sglang_source(relative):
    spec = importlib.util.find_spec("sglang")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sglang is not installed")
    return (Path(spec.submodule_search_locations[0]) / relative).read_text()


def test_installed_sglang_has_the_hooked_method_and_calls_it_with_the_waiting_queue():
    tree = ast.parse(sglang_source("srt/managers/schedule_policy.py"))
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SchedulePolicy"]
    [method] = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "calc_priority"]
    assert [a.arg for a in method.args.args][:2] == ["self", "waiting_queue"]
    assert "self.policy.calc_priority(\n            self.waiting_queue," in sglang_source("srt/managers/scheduler.py")
    # The rid reaches the scheduler's Req unchanged: Req(rid, ...) stores it as self.rid.
    assert "self.rid = rid" in sglang_source("srt/managers/schedule_batch.py")
    assert "load_plugins()" in sglang_source("srt/managers/scheduler.py")


def test_hook_through_sglangs_own_hook_registry():
    # Imports sglang (and torch): a few seconds.
    registry_module = pytest.importorskip("sglang.srt.plugins.hook_registry")
    HookRegistry, HookType = registry_module.HookRegistry, registry_module.HookType
    target = f"{__name__}.FakeSchedulePolicy.calc_priority"
    original = FakeSchedulePolicy.calc_priority
    HookRegistry.reset()
    try:
        HookRegistry.register(target, plugin.make_calc_priority_hook(PrefixAwareOrder()), HookType.AROUND)
        HookRegistry.apply_hooks()
        sched = FakeSchedulePolicy()
        queue = shuffled_forks()
        sched.calc_priority(queue, None, processed_tokens=3)
        assert sched.calls == [(7, None, 3)]
        assert parents(queue) == [0, 0, 1, 1, 2, 2, "u"]
    finally:
        FakeSchedulePolicy.calc_priority = original
        HookRegistry.reset()


def test_cpu_hooks_register_on_targets_the_installed_sglang_has(monkeypatch, tmp_path):
    import pkgutil

    registry_module = pytest.importorskip("sglang.srt.plugins.hook_registry")
    from policies import (core_lending, cpu_attention, cpu_layers, cpu_linear, cpu_sampling, idle_wait, lean_decode,
                          probe_readout, search_placement, step_timing)

    HookRegistry = registry_module.HookRegistry
    monkeypatch.delenv(plugin.ENV_POLICY, raising=False)
    monkeypatch.setenv(env_names.CPU_ATTENTION, cpu_attention.PAGED)
    monkeypatch.setenv(env_names.CPU_LINEAR, cpu_linear.PACKED)
    monkeypatch.setenv(env_names.CPU_LAYERS, cpu_layers.FUSED)
    monkeypatch.setenv(env_names.CPU_DECODE, lean_decode.LEAN)
    monkeypatch.setenv(env_names.CPU_SAMPLING, cpu_sampling.CDF)
    monkeypatch.setenv(env_names.DP_PLACEMENT, search_placement.SEARCH)
    monkeypatch.setenv(env_names.CORE_LENDING, core_lending.ON)
    monkeypatch.setenv(env_names.STEP_TRACE, str(tmp_path / "steps.jsonl"))
    head = tmp_path / "head.json"
    head.write_text('{"layer": 1, "weight": [0.5, -0.5]}')
    monkeypatch.setenv(env_names.PROBE_HEAD, str(head))
    HookRegistry.reset()
    try:
        plugin.register()
        registered = {target: [kind.name for kind, _, _ in hooks] for target, hooks in HookRegistry._hooks.items()}
    finally:
        HookRegistry.reset()
    assert registered == {cpu_attention.TARGET: ["AROUND"], cpu_attention.EXTEND_TARGET: ["AROUND"],
                          idle_wait.TARGET: ["REPLACE"],
                          cpu_linear.LINEAR_TARGET: ["AROUND"], cpu_linear.LM_HEAD_TARGET: ["AROUND"],
                          cpu_linear.NORMALIZER_TARGET: ["AROUND"],
                          cpu_layers.NORM_TARGET: ["AROUND"], cpu_layers.ROTARY_TARGET: ["AROUND"],
                          lean_decode.TARGET: ["AROUND"],
                          cpu_sampling.TARGET: ["AROUND"], cpu_sampling.FILTERED_TARGET: ["AROUND"],
                          cpu_sampling.SAMPLER_TARGET: ["AROUND"], cpu_sampling.SOFTMAX_TARGET: ["AROUND"],
                          search_placement.TARGET: ["AROUND"], step_timing.RUN_BATCH: ["AROUND"],
                          step_timing.MODEL_FORWARD: ["AROUND", "AROUND", "AROUND"]}  # lending, probe margins
    assert probe_readout.TARGET == core_lending.TARGET == step_timing.MODEL_FORWARD
    for target in registered:  # every target is a function or method of the installed SGLang, found as SGLang does
        assert callable(pkgutil.resolve_name(target)), target


def test_without_cpu_settings_register_installs_no_cpu_hook(monkeypatch):
    registry_module = pytest.importorskip("sglang.srt.plugins.hook_registry")
    HookRegistry = registry_module.HookRegistry
    for name in (plugin.ENV_POLICY, env_names.CPU_ATTENTION, env_names.CPU_LINEAR, env_names.CPU_LAYERS,
                 env_names.CPU_DECODE, env_names.CPU_SAMPLING,
                 env_names.CPU_DENORMALS, env_names.DP_PLACEMENT, env_names.CORE_LENDING, env_names.STEP_TRACE,
                 env_names.PROBE_HEAD):
        monkeypatch.delenv(name, raising=False)
    HookRegistry.reset()
    try:
        plugin.register()
        assert dict(HookRegistry._hooks) == {}
    finally:
        HookRegistry.reset()


@pytest.mark.parametrize("missing", ["SGLTTS_CPU_ATTENTION", "SGLTTS_CPU_LINEAR", "SGLTTS_CPU_LAYERS"])
def test_the_lean_decode_step_is_installed_only_with_the_kernels_it_calls(monkeypatch, capsys, missing):
    registry_module = pytest.importorskip("sglang.srt.plugins.hook_registry")
    from policies import cpu_attention, cpu_layers, cpu_linear, lean_decode

    HookRegistry = registry_module.HookRegistry
    for name in (plugin.ENV_POLICY, env_names.CPU_SAMPLING, env_names.CPU_DENORMALS, env_names.DP_PLACEMENT,
                 env_names.CORE_LENDING, env_names.STEP_TRACE, env_names.PROBE_HEAD):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(env_names.CPU_DECODE, lean_decode.LEAN)
    monkeypatch.setenv(env_names.CPU_ATTENTION, cpu_attention.PAGED)
    monkeypatch.setenv(env_names.CPU_LINEAR, cpu_linear.PACKED_BF16)
    monkeypatch.setenv(env_names.CPU_LAYERS, cpu_layers.FUSED)
    monkeypatch.setenv(missing, "sglang")
    HookRegistry.reset()
    try:
        plugin.register()
        assert lean_decode.TARGET not in HookRegistry._hooks
    finally:
        HookRegistry.reset()
    assert f"lean decode not installed: it computes with the kernels of {missing}, which" in capsys.readouterr().err


@pytest.mark.parametrize("setting, flushed", [("flush", True), ("keep", False)])
def test_the_denormals_setting_flushes_them_in_the_registering_thread(monkeypatch, setting, flushed):
    """SGLang's scheduler registers the plugin in the thread that runs its forward and sampling; FTZ/DAZ are per
    thread, so the flush has to happen there (policies/cpu_sampling.py)."""
    import threading

    torch = pytest.importorskip("torch")
    for name in (plugin.ENV_POLICY, env_names.CPU_ATTENTION, env_names.CPU_LINEAR, env_names.CPU_LAYERS,
                 env_names.CPU_DECODE, env_names.CPU_SAMPLING,
                 env_names.DP_PLACEMENT, env_names.STEP_TRACE, env_names.PROBE_HEAD):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(env_names.CPU_DENORMALS, setting)
    products = []

    def scheduler_thread() -> None:
        plugin.register()
        products.append((torch.tensor([1e-20]) * torch.tensor([1e-20])).item())  # 1e-40: denormal in fp32

    thread = threading.Thread(target=scheduler_thread)
    thread.start()
    thread.join()
    assert (products[0] == 0.0) is flushed and products[0] < 1.2e-38


@pytest.mark.parametrize("value, flags, head_flags", [
    ("packed", {"bf16": False, "grids": False}, {"sparse_heads": True}),
    ("packed-dense", {"bf16": False, "grids": False}, {"sparse_heads": False}),
    ("packed-bf16", {"bf16": True, "grids": False}, {"sparse_heads": True}),
    ("packed-bf16-int4", {"bf16": True, "grids": True}, {"sparse_heads": True}),
    ("packed-int4", {"bf16": False, "grids": True}, {"sparse_heads": True})])
def test_the_linear_setting_chooses_the_hooks(monkeypatch, value, flags, head_flags):
    registry_module = pytest.importorskip("sglang.srt.plugins.hook_registry")
    from policies import cpu_linear

    HookRegistry = registry_module.HookRegistry
    for name in (plugin.ENV_POLICY, env_names.CPU_ATTENTION, env_names.CPU_SAMPLING, env_names.CPU_DENORMALS,
                 env_names.DP_PLACEMENT, env_names.STEP_TRACE, env_names.PROBE_HEAD):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(env_names.CPU_LINEAR, value)
    HookRegistry.reset()
    try:
        plugin.register()
        hooks = {target: [function for _, function, _ in entries] for target, entries in HookRegistry._hooks.items()}
    finally:
        HookRegistry.reset()
    (layer_hook,), (head_hook,) = hooks.pop(cpu_linear.LINEAR_TARGET), hooks.pop(cpu_linear.LM_HEAD_TARGET)
    assert hooks == {cpu_linear.NORMALIZER_TARGET: [cpu_linear.normalizer_hook]}
    assert layer_hook.func is cpu_linear.linear_hook and layer_hook.keywords == flags
    assert head_hook.func is cpu_linear.lm_head_hook and head_hook.keywords == {**head_flags, **flags}
