"""One memory plan for all co-located runtimes: the split with floors, start-order-safe mem_fraction_static
(checked against SGLang's pool-size formula in every start order), device profile selection, and the
switches' three-runtime split."""

import dataclasses
import itertools
import logging
import random

import pytest

from sgl_tts.config import ConfigError
from sgl_tts.fasttts.switches import FastTTSConfig, configure_runtimes, describe_settings, from_label
from sgl_tts.runtime import hardware
from sgl_tts.runtime.hardware import GIB, HARDWARE, THIS_MACHINE, Hardware, plan_hardware, profile_for_device
from sgl_tts.runtime.memory_plan import (DEVICE_UTILIZATION, NEAR_TIE, kv_budget, longest_request_tokens, plan_memory,
                                         split_budget, start_order_safe_fractions)
from sgl_tts.runtime.roofline import Workload, load_model_spec
from sgl_tts.runtime.server import RuntimeConfig
from sgl_tts.search.api import SearchConfig

SEARCH = SearchConfig(n=8, beam_width=2, max_steps=4, max_step_tokens=48, max_tokens=192)
SMOL = RuntimeConfig(model="smollm2-135m", device="cpu")
MIB = 2**20


def test_split_never_exceeds_the_budget_and_keeps_every_floor():
    rng = random.Random(0)
    for _ in range(500):
        roles = ["generator", "verifier", "target"][:rng.randint(1, 3)]
        kv = {role: rng.randint(1, 50) for role in roles}
        planned = {role: rng.choice([0, rng.randint(1, 10_000)]) for role in roles}
        floor = rng.randint(1, 500)
        budget = rng.uniform(0.5, 5) * floor * sum(kv.values())
        if floor * sum(kv.values()) > budget:
            with pytest.raises(ValueError, match="longest request"):
                split_budget(planned, kv, budget, floor)
            continue
        tokens = split_budget(planned, kv, budget, floor)
        assert set(tokens) == set(roles)
        assert sum(tokens[r] * kv[r] for r in roles) <= budget
        assert all(tokens[r] >= floor for r in roles), (tokens, floor)
        # The runtimes above their floor keep the plan's ratio, up to rounding down to whole tokens: each one's
        # exact share lies in [tokens, tokens + 1) tokens.
        above = [r for r in roles if tokens[r] > floor and planned[r]]
        for a, b in itertools.permutations(above, 2):
            ratio = planned[a] * kv[a] / (planned[b] * kv[b])
            assert tokens[a] / (tokens[b] + 1) <= ratio * kv[b] / kv[a] <= (tokens[a] + 1) / tokens[b]
        # Nothing is left on the table beyond rounding.
        assert budget - sum(tokens[r] * kv[r] for r in roles) < sum(kv.values())


def sglang_pool_tokens(max_total_tokens, fraction, free_at_start, weights, kv_per_token):
    """SGLang's KV pool size (sglang.srt.mem_cache.kv_cache_configurator, _profile_available_bytes): the
    memory free after loading the weights, minus the slack free_at_start·(1 - fraction), capped by
    max_total_tokens."""
    profiled = (free_at_start - weights) - free_at_start * (1 - fraction)
    return min(max_total_tokens, int(profiled // kv_per_token))


@pytest.mark.parametrize("device, generator, verifier, target", [
    ("rtx4090", "qwen2.5-math-1.5b", "skywork-prm-1.5b", None),
    ("rtx4090", "qwen2.5-math-1.5b", "skywork-prm-1.5b", "qwen2.5-math-7b"),
    ("h200", "qwen2.5-math-7b", "skywork-prm-1.5b", "qwen2.5-math-7b"),
])
def test_every_start_order_gets_the_planned_pools(device, generator, verifier, target):
    hw = HARDWARE[device]
    models = {"generator": load_model_spec(generator), "verifier": load_model_spec(verifier)}
    if target:
        models["target"] = load_model_spec(target)
    plan = plan_memory(models["generator"], models["verifier"], hw, Workload(512, 512, 256, 0.35),
                       target=models.get("target"), min_tokens=2048)
    headroom = (1 - DEVICE_UTILIZATION) * hw.mem_bytes / len(models)
    for order in itertools.permutations(models):
        free = hw.mem_bytes
        for role in order:
            budget, model = plan.budgets[role], models[role]
            pool = sglang_pool_tokens(budget.max_total_tokens, budget.mem_fraction_static, free,
                                      model.weight_bytes, model.kv_bytes_per_token)
            assert pool == budget.max_total_tokens, f"{role} started after {order[:order.index(role)]}"
            free -= model.weight_bytes + budget.kv_bytes + headroom  # its activations use its headroom share
    # A fraction of the whole device (what the planner used to give) starves the runtime that starts last.
    last, budget = "generator", plan.budgets["generator"]
    free_last = hw.mem_bytes - sum(models[r].weight_bytes + plan.budgets[r].kv_bytes + headroom
                                   for r in models if r != last)
    naive = (models[last].weight_bytes + budget.kv_bytes) / hw.mem_bytes
    assert sglang_pool_tokens(budget.max_total_tokens, naive, free_last, models[last].weight_bytes,
                              models[last].kv_bytes_per_token) < budget.max_total_tokens


def test_fractions_refuse_needs_beyond_the_device():
    hw = HARDWARE["rtx4090"]
    with pytest.raises(ValueError, match="rtx4090"):
        start_order_safe_fractions(hw, {"generator": 15 * GIB, "verifier": 8 * GIB})
    assert all(0 < f < 1 for f in start_order_safe_fractions(hw, {"generator": 15 * GIB, "verifier": 6 * GIB}).values())


def test_device_profile_selection(monkeypatch):
    probed = Hardware(THIS_MACHINE, 1e11, 1e10, 16 * GIB, 1e10)
    monkeypatch.setattr(hardware, "probe_this_machine", lambda seconds=0.5: probed)
    assert plan_hardware("cuda", None, lambda: "NVIDIA GeForce RTX 4090") is HARDWARE["rtx4090"]
    assert plan_hardware("cuda", None, lambda: "NVIDIA  H200") is HARDWARE["h200"]
    assert plan_hardware("cuda", "rtx4070ti", lambda: "NVIDIA H200") is HARDWARE["rtx4070ti"], "config wins"
    with pytest.raises(KeyError, match=r"'NVIDIA H200 NVL'.*fasttts.hardware"):
        plan_hardware("cuda", None, lambda: "NVIDIA H200 NVL")
    with pytest.raises(ValueError, match="sees no CUDA device.*fasttts.hardware"):
        plan_hardware("cuda", None, lambda: None)
    with pytest.raises(ValueError, match="profiles the host"):
        plan_hardware("cuda", THIS_MACHINE, lambda: "NVIDIA H200")
    assert plan_hardware("cpu", None, lambda: pytest.fail("a CPU plan must not look for a GPU")) is probed
    assert profile_for_device("NVIDIA GeForce RTX 3070 Ti") is HARDWARE["rtx3070ti"]


def gpu_runtime(model, **fields):
    return RuntimeConfig(model=model, device="cuda", **fields)


def test_m_on_gpu_without_a_budget_takes_the_device_memory_and_logs_it(monkeypatch, caplog):
    monkeypatch.setattr(hardware, "cuda_device_name", lambda: "NVIDIA GeForce RTX 4090")
    monkeypatch.setattr(hardware, "probe_this_machine", lambda seconds=0.5: pytest.fail("probed the host"))
    # Hub ids, as a GPU run config names them (eval/configs/gpu-aime-amc.yaml): planned from the built-in configs.
    gen, ver = gpu_runtime("Qwen/Qwen2.5-Math-1.5B-Instruct"), gpu_runtime("Skywork/Skywork-o1-Open-PRM-Qwen-2.5-1.5B")
    with caplog.at_level(logging.WARNING):
        settings = configure_runtimes(from_label("M"), SEARCH, gen, ver)
    hw = HARDWARE["rtx4090"]
    specs = load_model_spec("qwen2.5-math-1.5b"), load_model_spec("skywork-prm-1.5b")
    assert settings.plan.hardware is hw and settings.plan.kv_budget == pytest.approx(kv_budget(hw, *specs))
    assert "rtx4090's memory" in caplog.text and "rtx4090's memory" in settings.budget_source
    used = sum(c.max_total_tokens * s.kv_bytes_per_token for c, s in zip((settings.generator, settings.verifier), specs))
    assert used <= settings.plan.kv_budget
    for config in (settings.generator, settings.verifier):
        assert 0 < config.mem_fraction_static < 1
    # No GPU in sight and no profile configured: an error naming the key, not a plan of host RAM.
    monkeypatch.setattr(hardware, "cuda_device_name", lambda: None)
    with pytest.raises(ConfigError, match="fasttts.hardware"):
        configure_runtimes(from_label("M"), SEARCH, gen, ver)


def test_three_runtimes_share_one_budget_and_each_holds_its_longest_request():
    target = RuntimeConfig(model="qwen2.5-math-1.5b", device="cpu")  # a bf16 pool on CPU: 28672 KV bytes a token
    rng = random.Random(1)
    floor = longest_request_tokens(FastTTSConfig().prompt_tokens, SEARCH.max_tokens, SEARCH.max_step_tokens)
    planned = 0
    for _ in range(20):
        budget_mib = rng.uniform(100, 2000)
        for fast in (from_label("M", kv_budget_mib=budget_mib, hardware="rtx4090", target_share=rng.random()),
                     FastTTSConfig(kv_budget_mib=budget_mib)):
            try:
                settings = configure_runtimes(fast, SEARCH, SMOL, SMOL, target, paths=rng.randint(1, 64))
            except ConfigError as exc:
                assert "longest request" in str(exc)
                continue
            runtimes = (settings.generator, settings.verifier, settings.target)
            kv = (23040, 23040, 28672)
            assert sum(c.max_total_tokens * k for c, k in zip(runtimes, kv)) <= budget_mib * MIB
            assert all(c.max_total_tokens >= floor for c in runtimes)
            assert settings.split == ("roofline" if fast.memory_plan else "static")
            planned += 1
    assert planned >= 20, "most budgets are large enough to plan"
    settings = configure_runtimes(from_label("M", kv_budget_mib=1000, hardware="rtx4090"), SEARCH, SMOL, SMOL, target)
    assert settings.plan.target is not None and settings.target.max_total_tokens == settings.plan.target.max_total_tokens
    assert "B_tgt=" in describe_settings(settings)


def test_a_scorer_on_the_generator_runtime_gets_its_share_there():
    target = dataclasses.replace(SMOL, max_total_tokens=5000)
    fast = from_label("M", kv_budget_mib=400, hardware="rtx4090")
    settings = configure_runtimes(fast, SEARCH, SMOL, None, target)
    assert settings.verifier is None
    plan = settings.plan
    assert settings.generator.max_total_tokens == plan.generator.max_total_tokens + plan.verifier.max_total_tokens
    assert settings.target.max_total_tokens == plan.target.max_total_tokens


def test_configured_budgets_of_three_runtimes_are_pooled():
    gen, ver, tgt = (dataclasses.replace(SMOL, max_total_tokens=t) for t in (6000, 3000, 3000))
    settings = configure_runtimes(from_label("M", hardware="rtx4090"), SEARCH, gen, ver, tgt)
    total = settings.generator.max_total_tokens + settings.verifier.max_total_tokens + settings.target.max_total_tokens
    assert 12000 - 3 < total <= 12000 and settings.budget_source == "the runtimes' max_total_tokens, pooled"
    mixed = dataclasses.replace(tgt, device="cuda")
    with pytest.raises(ConfigError, match="one device"):
        configure_runtimes(from_label("M", hardware="rtx4090"), SEARCH, gen, ver, mixed)


# ---- working sets, the cost of a too-small cache, the verifier's floor, the engine batch ----

def test_working_set_counts_the_prompt_once_and_the_shared_parents_once():
    from sgl_tts.runtime.memory_plan import search_working_sets, working_set_tokens

    # beam search n = 16, B = 4: 4 kept parents of 72 − 24 = 48 tokens, 16 own steps of 24, an 80-token prompt
    assert working_set_tokens(80, 16, 4, 72, 24) == 80 + 4 * 48 + 16 * 24 == 656
    assert working_set_tokens(80, 64, 16, 72, 24, searches=3) == 3 * (80 + 16 * 48 + 64 * 24) == 7152
    assert working_set_tokens(10, 4, 4, 30, 30) == 10 + 4 * 30, "no sharing below the prompt: n·L"
    assert search_working_sets(16, 4, 80, 72, 24) == {"generator": 656, "verifier": 656}
    assert search_working_sets(6, 4, 80, 72, 24)["generator"] == 80 + 2 * 48 + 6 * 24, "⌈6/4⌉ = 2 parents"
    with pytest.raises(ValueError, match="kept <= paths"):
        working_set_tokens(80, 4, 5, 72, 24)


def split_cost(budget_tokens, w_gen, w_ver, n=16, verifier="smollm2-135m"):
    from sgl_tts.runtime.memory_plan import SplitCost
    from sgl_tts.runtime.roofline import StepCosts

    gen, ver = load_model_spec("smollm2-135m", "float32"), load_model_spec(verifier, "float32")
    work = Workload(n, 116, 24)
    costs = StepCosts(gen, ver, HARDWARE["rtx4090"], work)
    return SplitCost(costs, gen, ver, HARDWARE["rtx4090"], budget_tokens * gen.kv_bytes_per_token,
                     {"generator": w_gen, "verifier": w_ver})


def brute_force_best(cost, floor):
    """Every verifier share in the same bounds: (the first within NEAR_TIE of the smallest time, that time)."""
    import numpy as np

    from sgl_tts.runtime.memory_plan import NEAR_TIE

    lo, hi = cost.bounds(floor)
    shares = np.arange(lo, hi + 1)
    times = cost(shares)
    return int(shares[np.argmax(times <= times.min() * (1 + NEAR_TIE))]), float(times.min())


def test_a_budget_that_holds_both_working_sets_gives_each_at_least_its_own():
    for budget, w_gen, w_ver in [(4000, 1500, 900), (2400, 1500, 900), (10000, 656, 656)]:
        cost = split_cost(budget, w_gen, w_ver)
        verifier = cost.best(floor=140)
        assert verifier >= w_ver and cost.generator_tokens(verifier) >= w_gen, (budget, verifier)
        assert float(cost(verifier)) <= brute_force_best(cost, 140)[1] * (1 + NEAR_TIE)


@pytest.mark.parametrize("seed", range(6))
def test_under_a_tight_budget_the_split_is_the_cost_models_optimum(seed):
    """Random tight budgets (below the two working sets), models and n: the candidate search finds the same
    minimum as trying every split, up to NEAR_TIE, and never a near-tie at a larger v than trying every split
    does; the verifier never gets less than min(W_ver, M − the generator's minimum)."""
    rng = random.Random(seed)
    n = rng.choice([4, 16, 64])
    w_gen, w_ver = rng.randint(600, 3000), rng.randint(300, 3000)
    budget = rng.randint(2 * 160 + 10, w_gen + w_ver - 1)
    cost = split_cost(budget, w_gen, w_ver, n, rng.choice(["smollm2-135m", "qwen2.5-math-1.5b"]))
    verifier = cost.best(floor=160)
    first_near_tie, best_time = brute_force_best(cost, 160)
    assert float(cost(verifier)) <= best_time * (1 + NEAR_TIE), verifier
    assert verifier >= first_near_tie  # the candidates are kinks: the first near-tie may sit inside a segment
    lo, _ = cost.bounds(160)
    beside = int((cost.budget - cost.generator_minimum(160) * cost.kv_gen) // cost.kv_ver)
    assert verifier >= lo == max(160, min(w_ver, beside))


def test_a_near_tie_goes_to_the_generator():
    """n = 256 on a 2-core CPU profile, a budget of half both working sets, the probe verifier (SmolLM2 cut after
    18 layers): the modelled optimum gives the verifier 7,728 tokens, 0.4% faster on paper than the generator's
    proportional share, and would leave the generator 30% of its working set (measured: 38 retractions). The
    plan takes the near-tie at the bound instead."""
    import numpy as np

    from sgl_tts.runtime.memory_plan import SplitCost, plan_workload, search_working_sets
    from sgl_tts.runtime.roofline import StepCosts

    gen = load_model_spec("smollm2-135m", "float32")
    ver = dataclasses.replace(gen, num_layers=18, weight_bytes=481296384.0, matmul_params=92012544.0)
    cpu = Hardware("two-cores", 1.0e11, 1.2e10, 25e9, 1.2e10)
    sets = search_working_sets(256, 4, 80, 72, 24)
    budget = 0.5 * (sets["generator"] * gen.kv_bytes_per_token + sets["verifier"] * ver.kv_bytes_per_token)
    cost = SplitCost(StepCosts(gen, ver, cpu, plan_workload(256, 80, 72, 24)), gen, ver, cpu, budget, sets)
    lo, hi = cost.bounds(176)
    shares = np.arange(lo, hi + 1)
    exact = int(shares[np.argmin(cost(shares))])
    assert exact > lo and float(cost(lo)) <= float(cost(exact)) * (1 + NEAR_TIE), "the case is a near-tie"
    assert cost.best(176) == lo
    assert cost.generator_tokens(lo) > cost.generator_tokens(exact) + 1000


def test_evicting_part_of_a_working_set_costs_its_re_prefill():
    cost = split_cost(4000, 1500, 900)
    # below W_ver every token taken from the verifier's cache adds R_ver (batches equal on both sides)
    assert float(cost(800) - cost(801)) == pytest.approx(cost.r_ver, rel=1e-6) or cost(800) > cost(801)
    assert cost.r_ver > 0 and cost.r_gen > 0


def test_planned_verifier_hit_falls_with_the_cache():
    from sgl_tts.runtime.memory_plan import planned_verifier_hit, working_set_tokens

    # n = 4, B = 2 (2 parents), Q = 10, 3 steps of 10: reads 4·(20 + 30 + 40) = 360; with the working set
    # cached, computed = 3·40 new + 10 (the question once) = 130, so the hit is 1 − 130/360.
    whole = working_set_tokens(10, 4, 2, 30, 10)
    assert planned_verifier_hit(whole, 10, 4, 2, 30, 10) == pytest.approx(1 - 130 / 360)
    # no cache: every iteration's working set less its new steps (W_k = 50, 70, 90) is computed again
    assert planned_verifier_hit(0, 10, 4, 2, 30, 10) == pytest.approx(1 - (130 + 10 + 30 + 50) / 360)
    hits = [planned_verifier_hit(c, 10, 4, 2, 30, 10) for c in range(0, whole + 1, 10)]
    assert hits == sorted(hits), "a larger cache never plans a lower hit"


def test_speculation_fills_the_batch_the_generators_kv_holds():
    from sgl_tts.runtime.memory_plan import engine_batch_for, plan_workload

    work = plan_workload(16, 80, 72, 24)  # S = 80 + 36 + 24 = 140
    assert engine_batch_for(1400, work) == 10 and engine_batch_for(100, work) == 1
    from sgl_tts.fasttts.switches import CPU_SPECULATION_BATCH

    s = from_label("P+M+S", kv_budget_mib=100, hardware="rtx4090")
    gpu = dataclasses.replace(SMOL, device="cuda")
    settings = configure_runtimes(s, SEARCH, gpu, gpu)
    search_work = plan_workload(SEARCH.n, s.prompt_tokens, SEARCH.max_tokens, SEARCH.max_step_tokens)
    expected = engine_batch_for(settings.plan.generator.max_total_tokens, search_work)
    assert settings.engine_batch == expected > CPU_SPECULATION_BATCH
    assert "speculation fills up to" in describe_settings(settings)
    on_cpu = configure_runtimes(s, SEARCH, SMOL, SMOL)
    assert engine_batch_for(on_cpu.plan.generator.max_total_tokens, search_work) > CPU_SPECULATION_BATCH, \
        "KV holds more"
    assert on_cpu.engine_batch == CPU_SPECULATION_BATCH, "a CPU generator: capped, extra sequences cost compute"
    given = configure_runtimes(dataclasses.replace(s, engine_batch=16), SEARCH, SMOL, SMOL)
    assert given.engine_batch == 16, "a given engine_batch stands, on a CPU too"
    assert configure_runtimes(from_label("P+M", kv_budget_mib=100, hardware="rtx4090"), SEARCH, SMOL,
                              SMOL).engine_batch is None, "no S, no engine batch"
    assert configure_runtimes(from_label("S"), SEARCH, SMOL, SMOL).engine_batch is None, "no known KV: no limit"
