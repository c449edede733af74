"""Roofline memory planner: hand arithmetic, brute force over all (B_pre, B_dec[, B_tgt]) choices, offloading,
and the `plan memory` command."""

import dataclasses
import json
import random

import pytest

from sgl_tts.runtime import roofline
from sgl_tts.runtime.roofline import (
    HARDWARE,
    Hardware,
    ModelSpec,
    Workload,
    StepCosts,
    decode_step_time,
    load_model_spec,
    model_spec_from_config,
    prefill_time,
    probe_this_machine,
    search_offload,
    search_shared,
)
from sgl_tts.cli import build_parser
from sgl_tts.runtime.memory_plan import bench_planner, plan_memory

SMOLLM2 = {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
           "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True, "torch_dtype": "bfloat16"}


def test_kv_bytes_per_token_by_hand(tmp_path):
    # SmolLM2-135M: 2 (K and V) · 30 layers · 3 KV heads · head dim 576/9 = 64 · 2 bytes.
    assert load_model_spec("smollm2-135m").kv_bytes_per_token == 2 * 30 * 3 * 64 * 2 == 23040
    assert model_spec_from_config(SMOLLM2, dtype="float32").kv_bytes_per_token == 46080
    (tmp_path / "config.json").write_text(json.dumps({**SMOLLM2, "head_dim": 80}))
    assert load_model_spec(str(tmp_path)).kv_bytes_per_token == 2 * 30 * 3 * 80 * 2
    # Qwen2.5-Math-7B: 28 layers, 4 KV heads, head dim 3584/28 = 128.
    assert load_model_spec("qwen2.5-math-7b").kv_bytes_per_token == 2 * 28 * 4 * 128 * 2


def test_hub_ids_of_built_in_models_need_no_download():
    assert load_model_spec("Qwen/Qwen2.5-Math-7B-Instruct") == dataclasses.replace(
        load_model_spec("qwen2.5-math-7b"), name="Qwen/Qwen2.5-Math-7B-Instruct")
    with pytest.raises(KeyError, match="built-in"):
        load_model_spec("./no/such/folder")


def test_parameter_count_is_close_to_the_published_size():
    assert load_model_spec("smollm2-135m").weight_bytes / 2 == pytest.approx(134.5e6, rel=0.01)
    assert load_model_spec("qwen2.5-math-7b").weight_bytes / 2 == pytest.approx(7.6e9, rel=0.02)


def test_bad_model_configs_name_the_problem(tmp_path):
    with pytest.raises(KeyError, match="intermediate_size"):
        model_spec_from_config({k: v for k, v in SMOLLM2.items() if k != "intermediate_size"}, "m")
    with pytest.raises(KeyError, match="smollm2-135m"):
        load_model_spec(str(tmp_path / "nope.json"))


def toy_model(weight_bytes=10.0, flops_params=0.0, layers=1):
    """One KV head of dimension 1 and 1-byte elements: kv_bytes_per_token = 2·layers."""
    return ModelSpec("toy", layers, 1, 1, 1, weight_bytes, flops_params, 1)


MEMORY_BOUND = Hardware("mem", peak_flops=1e30, mem_bandwidth=1.0, mem_bytes=1e9, link_bandwidth=1.0)


def test_roofline_times_by_hand():
    hw = Hardware("h", peak_flops=100.0, mem_bandwidth=10.0, mem_bytes=1e9, link_bandwidth=1.0)
    m = ModelSpec("m", num_layers=1, num_heads=1, num_kv_heads=1, head_dim=1, weight_bytes=20.0,
                  matmul_params=5.0, dtype_bytes=1)
    # Prefill of 2 sequences of 4 tokens: FLOPs 2·(2·5·4 + 2·1·1·1·16) = 144 → 1.44 s;
    # bytes 20 + 2·4·2 = 36 → 3.6 s.
    assert prefill_time(m, hw, 2, 4) == pytest.approx(3.6)
    # One decode step, 3 sequences, 10 cached: FLOPs 3·(10 + 4·10) = 150 → 1.5 s; bytes 20 + 3·10·2 = 80 → 8 s.
    assert decode_step_time(m, hw, 3, 10) == pytest.approx(8.0)
    fast_memory = Hardware("h", 100.0, 1e6, 1e9, 1.0)
    assert prefill_time(m, fast_memory, 2, 4) == pytest.approx(1.44)


def test_tiny_case_by_hand():
    # N=4, S = 0 + 2 tokens, KV per sequence 2·2 = 4 bytes for both models, M = 12 bytes:
    # feasible (B_pre, B_dec): (1, 1), (1, 2), (2, 1).
    # T_pre(b) = ⌈4/b⌉·(10 + 4b):          T_pre(1) = 56,  T_pre(2) = 36.
    # T_dec(b) = ⌈4/b⌉·2·(10 + b·1·2):      T_dec(1) = 96,  T_dec(2) = 56   (S̄_cache = 1).
    # Totals: 152, 112, 132 → (1, 2).
    costs = StepCosts(toy_model(), toy_model(), MEMORY_BOUND, Workload(4, 0, 2))
    best = search_shared(costs, 12)
    assert (best.b_pre, best.b_dec, best.t_total) == (1, 2, pytest.approx(112))
    assert brute_force(costs, 12)[:2] == (1, 2)


def brute_force(costs, budget):
    """Every (B_pre, B_dec, B_tgt) within the budget (B_tgt = 0 without a target or with nothing for it to
    rewrite); the fastest, ties to the larger B_dec, then B_pre, then B_tgt. Returns (B_pre, B_dec, T, B_tgt)."""
    n, n_tgt = costs.work.n, costs.work.target_n
    targets = range(1, n_tgt + 1) if costs.has_target and n_tgt else [0]
    triples = [(b_pre, b_dec, b_tgt) for b_pre in range(1, n + 1) for b_dec in range(1, n + 1) for b_tgt in targets
               if b_pre * costs.kv_ver_seq + b_dec * costs.kv_gen_seq + b_tgt * costs.kv_tgt_seq <= budget]
    if not triples:
        return None
    time_of = {t: costs.verify[t[0]] + costs.generate[t[1]] + costs.target[t[2]] for t in triples}
    fastest = min(time_of.values())
    b_pre, b_dec, b_tgt = max((t for t in triples if time_of[t] <= fastest * (1 + 1e-12)),
                              key=lambda t: (t[1], t[0], t[2]))
    return b_pre, b_dec, time_of[b_pre, b_dec, b_tgt], b_tgt


def random_spec(rng, name):
    return ModelSpec(name, rng.randint(1, 3), 2, rng.randint(1, 2), 2, rng.uniform(1, 500), rng.uniform(0, 1e4), 1)


def random_case(rng, with_target=False):
    hw = Hardware("r", rng.choice([1e3, 1e5, 1e30]), rng.choice([1.0, 10.0, 100.0]), 1e12, 1.0)
    target = random_spec(rng, "t") if with_target else None
    share = rng.choice([0.0, 0.25, 0.5, 1.0, rng.random()]) if with_target else 0.0
    work = Workload(rng.randint(1, 14), rng.randint(0, 6), rng.randint(1, 6), share)
    costs = StepCosts(random_spec(rng, "g"), random_spec(rng, "v"), hw, work, target)
    per_set = costs.kv_ver_seq + costs.kv_gen_seq + costs.kv_tgt_seq
    return costs, rng.uniform(0.5, work.n * 1.5) * per_set


@pytest.mark.parametrize("with_target", [False, True])
def test_search_matches_brute_force_and_respects_the_budget(with_target):
    rng = random.Random(0)
    for _ in range(300):
        costs, budget = random_case(rng, with_target)
        found, expected = search_shared(costs, budget), brute_force(costs, budget)
        if expected is None:
            assert found is None
            continue
        assert (found.b_pre, found.b_dec, found.b_tgt) == (expected[0], expected[1], expected[3])
        assert found.t_total == pytest.approx(expected[2])
        used = found.b_pre * costs.kv_ver_seq + found.b_dec * costs.kv_gen_seq + found.b_tgt * costs.kv_tgt_seq
        assert used <= budget


def test_ties_go_to_the_larger_decode_batch():
    # Compute-bound only and N = 4: ⌈4/b⌉·b·c is 4c for b = 1, 2 and 4, so (1,1), (1,2), (2,1) all tie.
    hw = Hardware("flops", peak_flops=1.0, mem_bandwidth=1e30, mem_bytes=1e9, link_bandwidth=1.0)
    costs = StepCosts(toy_model(flops_params=1.0), toy_model(flops_params=1.0), hw, Workload(4, 0, 2))
    assert costs.verify[1] == costs.verify[2] and costs.generate[1] == costs.generate[2]
    best = search_shared(costs, 12)
    assert (best.b_pre, best.b_dec) == (1, 2)
    # With room for (2, 2): (1,1), (1,2), (2,1), (2,2) all tie; the larger B_dec first, then the larger B_pre.
    best = search_shared(costs, 16)
    assert (best.b_pre, best.b_dec) == (2, 2) == brute_force(costs, 16)[:2]


def test_a_compute_bound_verifier_gets_the_whole_batch_at_the_same_time():
    # The planner used to pick B_pre = 1 here (prefill is compute-bound, so T_tot does not change with B_pre)
    # and left the verifier 384 tokens of KV, one path's worth.
    gen, ver = load_model_spec("qwen2.5-math-1.5b"), load_model_spec("skywork-prm-1.5b")
    plan = plan_memory(gen, ver, HARDWARE["rtx4090"], Workload(16, 256, 128))
    assert (plan.shared.b_pre, plan.shared.b_dec) == (16, 16)
    assert plan.shared.t_total == pytest.approx(plan.static.t_total)
    assert plan.verifier.max_total_tokens >= 16 * 384 and plan.generator.max_total_tokens >= 16 * 384


def test_a_smaller_decode_batch_can_win():
    # ⌈N/B⌉ makes the decode term non-monotone: with N = 10 and memory-bound decode, B = 5 (2 rounds)
    # beats B = 6 (also 2 rounds, more KV traffic), so the bound on B_dec is not always the answer.
    # The verifier's KV (6 layers: 24 bytes a sequence) leaves room for B_pre = 1 and B_dec <= 6 only.
    costs = StepCosts(toy_model(), toy_model(layers=6), MEMORY_BOUND, Workload(10, 0, 2))
    assert costs.generate[5] < costs.generate[6]
    best = search_shared(costs, 24 + 6 * 4)
    assert (best.b_pre, best.b_dec) == (1, 5) == brute_force(costs, 24 + 6 * 4)[:2]


def test_offload_wins_when_memory_is_tiny_and_the_link_fast():
    gen, ver = toy_model(), toy_model()
    work = Workload(8, 0, 2)
    fast = Hardware("fast-link", 1e30, 1.0, 1e9, link_bandwidth=1e9)
    # M = 6 bytes holds one 4-byte sequence, not one per model: only offloading is feasible, and co-located
    # runtimes get no budgets.
    plan = plan_memory(gen, ver, fast, work, budget=6)
    assert plan.shared is None and plan.chosen.mode == "offload" and plan.budgets == {}
    # M = 32: shared can run (4, 4) at most; offloaded, each model runs all 8 at once.
    plan = plan_memory(gen, ver, fast, work, budget=32)
    assert plan.chosen.mode == "offload" and (plan.chosen.b_pre, plan.chosen.b_dec) == (8, 8)
    assert plan.chosen.t_total < plan.shared.t_total
    assert plan.chosen.overhead == pytest.approx(2 * (8 * 4 + 8 * 4) / 1e9)
    slow = Hardware("slow-link", 1e30, 1.0, 1e9, link_bandwidth=1e-3)
    assert plan_memory(gen, ver, slow, work, budget=32).chosen.mode == "shared"


def test_offload_search_takes_each_models_best_within_the_whole_budget():
    rng = random.Random(1)
    for _ in range(100):
        costs, budget = random_case(rng)
        found = search_offload(costs, budget, HARDWARE["rtx4090"])
        n = costs.work.n
        pres = [b for b in range(1, n + 1) if b * costs.kv_ver_seq <= budget]
        decs = [b for b in range(1, n + 1) if b * costs.kv_gen_seq <= budget]
        if not pres or not decs:
            assert found is None
            continue
        assert costs.verify[found.b_pre] == pytest.approx(min(costs.verify[b] for b in pres))
        assert costs.generate[found.b_dec] == pytest.approx(min(costs.generate[b] for b in decs))
        assert found.b_pre == max(b for b in pres if costs.verify[b] <= costs.verify[found.b_pre] * (1 + 1e-12))


def test_plan_budgets_for_the_runtimes():
    gen, ver = load_model_spec("qwen2.5-math-1.5b"), load_model_spec("skywork-prm-1.5b")
    plan = plan_memory(gen, ver, HARDWARE["rtx4090"], Workload(64, 512, 256), budget=2 * roofline.GIB)
    assert plan.chosen.mode == "shared"
    used = plan.generator.kv_bytes + plan.verifier.kv_bytes
    assert plan.kv_budget - gen.kv_bytes_per_token - ver.kv_bytes_per_token < used <= plan.kv_budget
    assert plan.verifier.max_total_tokens >= plan.chosen.b_pre * 768
    assert plan.generator.max_total_tokens >= plan.chosen.b_dec * 768
    # What the batches leave is shared in proportion to the planned KV (equal models: the batch ratio).
    ratio = plan.generator.max_total_tokens / plan.verifier.max_total_tokens
    assert ratio == pytest.approx(plan.chosen.b_dec / plan.chosen.b_pre, rel=1e-3)
    assert plan.static is not None and plan.chosen.t_total <= plan.static.t_total * (1 + 1e-12)


def test_no_memory_left_is_an_error():
    gen, ver = load_model_spec("qwen2.5-math-1.5b"), load_model_spec("qwen2.5-math-prm-7b")
    with pytest.raises(ValueError, match="rtx3070ti"):
        plan_memory(gen, ver, HARDWARE["rtx3070ti"], Workload(16, 256, 128))


def test_hardware_profiles():
    assert set(HARDWARE) == {"rtx4090", "rtx4070ti", "rtx3070ti", "h200"}
    for hw in HARDWARE.values():
        assert hw.peak_flops > 1e13 and hw.mem_bandwidth > 1e11 and hw.mem_bytes > 4e9 and hw.link_bandwidth > 1e10
    with pytest.raises(KeyError, match="this-machine"):
        roofline.get_hardware("a100")


def test_probe_this_machine_is_quick_and_positive():
    hw = probe_this_machine(seconds=0.05)
    assert hw.name == "this-machine"
    assert hw.peak_flops > 0 and hw.mem_bandwidth > 0 and hw.mem_bytes > 0


def test_bench_planner_reports_each_n():
    timings = bench_planner(ns=(8, 16), repeats=1)
    assert set(timings) == {8, 16} and all(t > 0 for t in timings.values())


def test_plan_memory_command(capsys):
    parser = build_parser()
    args = parser.parse_args(["plan", "memory", "--hardware", "rtx4090", "--generator-config", "qwen2.5-math-1.5b",
                              "--verifier-config", "skywork-prm-1.5b", "--n", "32", "--memory-gb", "1"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "--max-total-tokens" in out and "--mem-fraction-static" in out and "roofline projections" in out
    args = parser.parse_args(["plan", "memory", "--hardware", "h200", "--generator-config", "qwen2.5-math-1.5b",
                              "--verifier-config", "skywork-prm-1.5b", "--target-config", "qwen2.5-math-7b"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "B_tgt=" in out and [line.split()[0] for line in out.splitlines() if "--max-total-tokens" in line] == \
        ["generator", "verifier", "target"]
    args = parser.parse_args(["plan", "memory", "--hardware", "a100"])
    assert args.func(args) == 2
    assert "unknown hardware" in capsys.readouterr().out
