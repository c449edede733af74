"""FastTTS switches: config, runtime settings (P's env, S's priority flag, M's KV split), request tags, and
equivalence: with S off, the baseline and P+M choose the same beams."""

import dataclasses

import pytest

from sgl_tts.problems import Problem
from policies.base import decode_rid
from policies.plugin import ENV_POLICY
from sgl_tts.config import ConfigError, load_dataclass
from sgl_tts.fasttts.switches import PRIORITY_FLAG, FastTTSConfig, configure_runtimes, from_label
from sgl_tts.search.programs import load_program
from sgl_tts.runtime.hardware import HARDWARE
from sgl_tts.runtime.memory_plan import (MIB, longest_request_tokens, model_spec_for, plan_memory, plan_workload,
                                         search_working_sets)
from sgl_tts.runtime.server import RuntimeConfig
from sgl_tts.search.api import Runtimes, SearchConfig
from sgl_tts.app.session import RunConfig
from sgl_tts.testing import ScriptedBackend, ScriptedModel, ScriptedScorer

PROMPT = "Q: what is two plus two?\n\n"
PROBLEM = Problem(id="p1", question="what is two plus two?", gold="4")
SEARCH = SearchConfig(n=8, beam_width=2, max_steps=4, max_step_tokens=48, max_tokens=192)
SMOL = RuntimeConfig(model="smollm2-135m", device="cpu")
KV_FP32 = 46080  # SmolLM2-135M KV bytes per token in fp32 (2·30·3·64·4)
KV_BF16 = KV_FP32 // 2  # in bf16, the CPU runtime's pool by default (RuntimeConfig.kv_cache_dtype "auto")


def test_config_validates_and_loads_from_yaml_mapping():
    with pytest.raises(ValueError, match="more than 10"):
        FastTTSConfig(standard_priority=5, speculative_priority=0)
    with pytest.raises(ValueError, match="truncation_ratio"):
        FastTTSConfig(truncation_ratio=1.5)
    with pytest.raises(ValueError, match="unknown hardware 'tpu'.*rtx4090"):
        FastTTSConfig(hardware="tpu")
    with pytest.raises(ConfigError, match="fasttts.speculate"):
        load_dataclass(RunConfig, {"fasttts": {"speculate": True}}, "run.yaml")
    config = load_dataclass(RunConfig, {"fasttts": {"prefix_order": True, "kv_budget_mib": 96}}, "run.yaml")
    assert config.fasttts == FastTTSConfig(prefix_order=True, kv_budget_mib=96.0)
    assert RunConfig().fasttts.label == "baseline", "all switches default to off"


def test_labels_name_the_switches():
    assert [from_label(label).label for label in ("baseline", "P", "P+M", "P+M+S", "S")] == \
        ["baseline", "P", "P+M", "P+M+S", "S"]
    assert from_label("P+M+S", truncation_ratio=0.5).truncation_ratio == 0.5
    for bad in ("Q", "P+P", "P+", ""):
        with pytest.raises(ValueError, match="bad arm"):
            from_label(bad)


def test_baseline_is_fcfs_without_priorities_and_a_50_50_split():
    fast = FastTTSConfig(kv_budget_mib=200)
    settings = configure_runtimes(fast, SEARCH, SMOL, SMOL)
    half_tokens = int(200 * MIB / 2 // KV_BF16)
    assert settings.split == "static"
    assert settings.generator.max_total_tokens == settings.verifier.max_total_tokens == half_tokens
    assert settings.generator.env[ENV_POLICY] == "fcfs"
    assert PRIORITY_FLAG not in settings.generator.extra_args
    assert ENV_POLICY not in settings.verifier.env, "the verifier runs no policy"


def test_p_sets_the_plugin_policy_and_s_enables_priority_scheduling():
    settings = configure_runtimes(from_label("P+S", standard_priority=30), SEARCH, SMOL, SMOL)
    assert settings.generator.env[ENV_POLICY] == "prefix"
    assert settings.generator.extra_args == [PRIORITY_FLAG, "--default-priority-value", "30",
                                             "--retraction-policy", "priority"]
    assert settings.split == "as configured" and settings.generator.max_total_tokens is None
    again = configure_runtimes(from_label("S"), SEARCH, settings.generator, None)
    assert again.generator.extra_args.count(PRIORITY_FLAG) == 1, "the flag is not added twice"
    assert again.generator.env[ENV_POLICY] == "fcfs", "P off resets the policy to the baseline"


def test_m_splits_the_budget_by_the_roofline_plan_with_a_floor_for_every_runtime():
    fast = from_label("P+M", kv_budget_mib=300, hardware="rtx4090")
    settings = configure_runtimes(fast, SEARCH, SMOL, SMOL)
    spec = model_spec_for(SMOL)
    assert spec.kv_bytes_per_token == KV_BF16
    floor = longest_request_tokens(fast.prompt_tokens, SEARCH.max_tokens, SEARCH.max_step_tokens)
    work = plan_workload(SEARCH.n, fast.prompt_tokens, SEARCH.max_tokens, SEARCH.max_step_tokens)
    # n = 8, B = 2: 4 kept parents; 128 + 4·(192 − 48) + 8·48 = 1088 tokens for each runtime
    sets = search_working_sets(SEARCH.n, SEARCH.beam_width, fast.prompt_tokens, SEARCH.max_tokens,
                               SEARCH.max_step_tokens)
    assert sets == {"generator": 1088, "verifier": 1088}
    plan = plan_memory(spec, spec, HARDWARE["rtx4090"], work, 300 * MIB, min_tokens=floor, working_sets=sets)
    assert settings.split == "roofline" and settings.plan.shared == plan.shared
    assert settings.plan.working_sets == sets
    assert settings.verifier.max_total_tokens == plan.verifier.max_total_tokens >= 1088, "its working set"
    assert settings.generator.max_total_tokens == plan.generator.max_total_tokens >= 1088
    total = (settings.generator.max_total_tokens + settings.verifier.max_total_tokens) * KV_BF16
    assert 300 * MIB - 2 * KV_BF16 < total <= 300 * MIB, "the whole budget is handed out"
    assert settings.generator.mem_fraction_static is None, "CPU runtimes get no GPU memory fraction"
    # 20 MiB hold 910 tokens, less than the two working sets (2176): the verifier gets at least its share in
    # proportion to the working sets (455), the generator at least its longest request (368); the cost decides.
    tight = configure_runtimes(dataclasses.replace(fast, kv_budget_mib=20), SEARCH, SMOL, SMOL)
    assert floor == 368 and 455 <= tight.verifier.max_total_tokens <= 910 - 368
    assert tight.generator.max_total_tokens + tight.verifier.max_total_tokens in (909, 910)


def test_m_without_a_budget_pools_the_configured_budgets():
    gen = dataclasses.replace(SMOL, max_total_tokens=6000)
    ver = dataclasses.replace(SMOL, max_total_tokens=3000)
    settings = configure_runtimes(from_label("M", hardware="rtx4090"), SEARCH, gen, ver)
    assert settings.generator.max_total_tokens + settings.verifier.max_total_tokens == 9000
    assert configure_runtimes(FastTTSConfig(), SEARCH, gen, ver).generator.max_total_tokens == 6000


def test_a_shared_runtime_gets_the_whole_budget_and_too_small_budgets_are_refused():
    settings = configure_runtimes(FastTTSConfig(kv_budget_mib=50), SEARCH, SMOL, None)
    assert settings.verifier is None and settings.generator.max_total_tokens == int(50 * MIB // KV_BF16)
    with pytest.raises(ConfigError, match=r"kv_budget_mib.*(generator|verifier).*longest request"):
        configure_runtimes(FastTTSConfig(kv_budget_mib=10), SEARCH, SMOL, SMOL)


# ---- the search side, on the scripted backend ----

def run_beam_search(model=None):
    backend = ScriptedBackend(model or ScriptedModel(answer_depth=3, answer_chance=0.3))
    scorer = ScriptedScorer()
    runtimes = Runtimes(generator=backend, scorer=scorer, prompt=lambda q: PROMPT)
    return load_program("beam_search")(PROBLEM, SEARCH, runtimes), backend, scorer


def summary(result):
    return sorted((c.text, tuple(c.step_scores), c.answer, c.finish_reason) for c in result.candidates)


@pytest.mark.parametrize("model", [ScriptedModel(answer_depth=3, answer_chance=0.3), ScriptedModel(answer_depth=10)])
def test_the_search_is_the_same_however_often_it_runs(model):
    """P and M change runtime settings only (tested above); the search itself is reproducible, and every
    request it sends carries a lineage tag whatever the switches."""
    first, first_backend, first_scorer = run_beam_search(model)
    again, _, again_scorer = run_beam_search(model)
    assert summary(first) == summary(again) and first.answer == again.answer
    as_sets = lambda calls: [sorted(map(tuple, call)) for call in calls]
    assert as_sets(first_scorer.calls) == as_sets(again_scorer.calls), "the verifier sees the same steps"
    assert all(decode_rid(r["fields"]["rid"]) is not None for r in first_backend.requests)


def fake_session_runtimes(monkeypatch):
    """Sessions on fake runtimes: the started runtimes (in start order) and run configs by FastTTS label."""
    from sgl_tts.app import session as session_module
    from sgl_tts.scoring.scorer_config import ScorerConfig
    started = []

    class FakeRuntime:
        def __init__(self, config, name):
            self.config, self.name, self.model_path = config, name, "model"
            self.url, self.stopped = f"http://127.0.0.1:1/{name}{len(started)}", False

        def wait_ready(self):
            pass

        def alive(self):
            return not self.stopped

        def stop(self):
            self.stopped = True

    def start(config, name="generator", log_dir=None, wait=True):
        started.append(FakeRuntime(config, name))
        return started[-1]

    monkeypatch.setattr(session_module.Runtime, "start", staticmethod(start))
    class FakeEndpoint:  # the real one asks the server for its model info
        def __init__(self, runtime, standard_priority=None, send_seed=False):
            self.runtime, self.standard_priority = runtime, standard_priority

    monkeypatch.setattr("sgl_tts.frontend.backend.TTSEndpoint", FakeEndpoint)
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda path: None)
    base = RunConfig(generator=SMOL, scorer=ScorerConfig(runtime=SMOL), search=SEARCH, concurrency=1)
    # 300 MiB hold both working sets (1088 tokens each): M gives the verifier its own and the generator the
    # rest, unlike the static halves (test_m_splits_the_budget_...)
    return started, lambda label: dataclasses.replace(base, fasttts=from_label(label, kv_budget_mib=300,
                                                                                  hardware="rtx4090"))


def test_a_session_restarts_only_the_runtimes_whose_settings_differ(monkeypatch):
    from sgl_tts.runtime.server import share_cpu_cores
    from sgl_tts.app.session import Session
    started, arm = fake_session_runtimes(monkeypatch)

    first = Session(arm("baseline"))
    assert [r.name for r in started] == ["generator", "scorer"]
    generator, scorer = first.runtimes["generator"], first.runtimes["scorer"]
    second = Session(arm("P"), reuse=first.detach())  # P changes the generator's env only
    assert second.runtimes["scorer"] is scorer and second.runtimes["generator"] is not generator
    assert generator.stopped and not scorer.stopped and len(started) == 3
    third = Session(arm("P+M+S"), reuse=second.detach())  # M changes both budgets
    assert len(started) == 5 and scorer.stopped and second.runtimes == {}
    assert third.fasttts.split == "roofline"
    # the planned generator settings, with the CPU cores split between the two runtimes
    planned = share_cpu_cores({"generator": third.fasttts.generator, "scorer": third.fasttts.verifier})
    assert third.runtimes["generator"].config == planned["generator"]
    assert third.runtimes["generator"].config.max_total_tokens == third.fasttts.generator.max_total_tokens
    generator_backend = third.search_runtimes.generator
    assert generator_backend.standard_priority == third.config.fasttts.standard_priority, "S: standard priority"
    extension = third.new_search(type("Problem", (), {"id": "p"})()).extension
    assert extension.client.runtime is third.runtimes["generator"], "S: speculation goes to the generator runtime"
    assert second.search_runtimes.extension_factory is None, "no extension without S"
    same = Session(arm("P+M+S"), reuse=third.detach())
    assert len(started) == 5, "identical settings reuse both runtimes"
    same.close()
    assert all(r.stopped for r in started)


def test_a_session_pool_keeps_sets_of_runtimes_and_offers_the_oldest_when_full(monkeypatch):
    from sgl_tts.app.session import SessionPool
    started, arm = fake_session_runtimes(monkeypatch)
    pool = SessionPool(live=2, available_bytes=lambda: float("inf"))
    baseline = pool.switch(arm("baseline"))
    assert baseline.reused == [] and len(started) == 2
    pool.give_back(baseline)
    full = pool.switch(arm("P+M+S"))  # room for two sets: the baseline's stay untouched
    assert full.reused == [] and len(started) == 4 and not any(r.stopped for r in started)
    pool.give_back(full)
    again = pool.switch(arm("baseline"))
    assert sorted(again.reused) == ["generator", "scorer"] and len(started) == 4, "the same settings: kept"
    pool.give_back(again)
    p_only = pool.switch(arm("P"))  # full: the oldest set (P+M+S) is offered, M's budgets differ from P's
    assert p_only.reused == [] and [r.stopped for r in started] == [False, False, True, True, False, False]
    pool.give_back(p_only)
    scorer = started[1]
    baseline_again = pool.switch(arm("baseline"))  # kept, though P was given back after it
    assert baseline_again.runtimes["scorer"] is scorer and len(started) == 6
    pool.give_back(baseline_again)
    just_p = pool.switch(arm("P"))
    assert sorted(just_p.reused) == ["generator", "scorer"]
    just_p.close()
    pool.close()
    assert all(r.stopped for r in started)
    one = SessionPool(live=1, available_bytes=lambda: float("inf"))
    one.give_back(one.switch(arm("baseline")))
    p_after = one.switch(arm("P"))  # the one kept set is offered: P changes the generator only
    assert p_after.reused == ["scorer"] and started[-3].stopped and not started[-2].stopped
    p_after.close()
    one.close()


def test_a_session_pool_keeps_no_more_sets_than_the_hosts_memory_holds(monkeypatch):
    from sgl_tts.app.session import SERVER_HOST_BYTES, SessionPool, host_bytes_needed, planned_runtimes
    started, arm = fake_session_runtimes(monkeypatch)
    configs = planned_runtimes(arm("baseline"))[1]
    one_set = host_bytes_needed(configs)
    specs = {name: model_spec_for(config) for name, config in configs.items()}
    assert one_set == sum(SERVER_HOST_BYTES + specs[name].weight_bytes
                          + config.max_total_tokens * specs[name].kv_bytes_per_token
                          for name, config in configs.items()), "per CPU server: processes, weights, KV"
    free = [1.5 * one_set]
    pool = SessionPool(live=3, available_bytes=lambda: free[0])
    pool.give_back(pool.switch(arm("baseline")))
    free[0] = 0.5 * one_set  # the first set took its share: no room for a second
    p_only = pool.switch(arm("P"))  # the baseline's set goes, lending the scorer P shares with it
    assert p_only.reused == ["scorer"] and started[0].stopped and len(started) == 3
    pool.give_back(p_only)
    free[0] = 10 * one_set
    with_m = pool.switch(arm("P+M"))  # room again: P's set stays beside the new one
    assert with_m.reused == [] and not any(r.stopped for r in started[1:])
    with_m.close()
    pool.close()


def test_bench_cells_medians_ranges_and_claims():
    from sgl_tts.bench.fasttts import FastTTSArm, compare, format_table, measure
    from sgl_tts.search.records import Candidate, SearchResult

    def result(tokens, seconds, verifier_s=0.0, speculation=None, verifier_calls=()):
        candidate = Candidate(steps=["a"], step_scores=[0.5], score=0.5, answer="4", tokens=tokens,
                              completion_time_s=seconds, finish_reason="answer")
        extra = {"verifier_iterations": [{"input_tokens": read, "cached_tokens": cached}
                                         for read, cached in verifier_calls]}
        if speculation:
            extra["speculation"] = speculation
        return SearchResult(problem_id="p", program="beam_search", answer="4", candidates=[candidate],
                            generated_tokens=tokens, prompt_tokens=100, cached_tokens=90, total_time_s=seconds,
                            generator_time_s=seconds, verifier_time_s=verifier_s, extra=extra)

    # the verifier's hit: Σ cached / Σ input over every scorer call of every search (40 + 10) / (120 + 80)
    base = measure([result(10, 10.0, 2.5, verifier_calls=[(100, 40), (20, 0)]),
                    result(30, 10.0, 2.5, verifier_calls=[(80, 10)])], plan={"planned_verifier_hit": 0.3})
    assert base["planned_verifier_hit"] == 0.3
    assert base["goodput"] == pytest.approx(2.0) and base["p50_latency_s"] == 10.0
    assert base["verifier_cache_hit"] == pytest.approx(0.25) and base["verifier_share"] == pytest.approx(0.2)
    fast = measure([result(10, 2.0, speculation={"launched": 3}), result(30, 6.0, speculation={"launched": 2})])
    assert fast["goodput"] == pytest.approx(5.0) and fast["speculation"] == {"launched": 5}
    # straggler tails: Σ idle slot-s over Σ k·span of every iteration; S's held slot-s against the idle ones
    tails = result(10, 2.0, speculation={"slot_s": 1.5})
    tails.extra["straggler_tails"] = [{"requests": 4, "span_s": 1.0, "idle_slot_s": 1.0},
                                      {"requests": 2, "span_s": 2.0, "idle_slot_s": 2.0}]
    tailed = measure([tails, result(10, 2.0)])
    assert tailed["tail_idle_slot_s"] == pytest.approx(3.0) and tailed["tail_idle_share"] == pytest.approx(3 / 8)
    assert tailed["tail_filled_by_s"] == pytest.approx(0.5)
    # medians, and a claim only where the ranges do not overlap
    assert compare([5.0, 6.0, 4.0], [2.0, 2.5, 1.5], lower_is_better=False) == (pytest.approx(2.5), True)
    assert compare([5.0, 6.0, 2.0], [2.0, 2.5, 1.5], lower_is_better=False)[1] is False, "overlapping ranges"
    assert compare([3.0, 4.0], [8.0, 9.0], lower_is_better=True) == (pytest.approx(3.5 / 8.5), True)
    assert compare([9.0], [2.0], lower_is_better=False) == (pytest.approx(4.5), False), "one run claims nothing"
    cells = {("beam_search", 8, 0.5, "baseline"): [base, base], ("beam_search", 8, 0.5, "all"): [fast, fast]}
    lines = format_table(cells, ["beam_search"], [8], [0.5], ["baseline", "V", "all"]).splitlines()
    assert len(lines) == 3, "a header, then one line per measured arm"
    assert "1.00x " in lines[1] and "2.50x*" in lines[2] and "0.40x*" in lines[2]
    assert "0.30/0.25" in lines[1], "the verifier's hit, planned/measured"
    assert FastTTSArm.parse("all") == FastTTSArm("all", "P+M+S", True)
    assert FastTTSArm.parse("V") == FastTTSArm("V", "baseline", True)
    assert FastTTSArm.parse("P+M") == FastTTSArm("P+M", "P+M", False)
    assert FastTTSArm.parse("baseline") == FastTTSArm("baseline", "baseline", False)
    for bad in ("Q", "V+V", ""):
        with pytest.raises(ValueError, match="bad arm"):
            FastTTSArm.parse(bad)


def test_co_located_cpu_runtimes_get_cores_by_what_they_do():
    from sgl_tts.runtime.server import RuntimeConfig, share_cpu_cores

    alone = share_cpu_cores({"generator": RuntimeConfig()}, cores=2)["generator"]
    assert (alone.data_parallel, alone.cpu_threads) == (2, 1), "the generator: a single-threaded rank per core"
    pair = share_cpu_cores({"generator": RuntimeConfig(), "scorer": RuntimeConfig(max_total_tokens=8)}, cores=8)
    assert [(c.data_parallel, c.cpu_threads) for c in pair.values()] == [(8, 1), (1, 1)]
    assert all("OMP_WAIT_POLICY" not in c.env for c in pair.values()), "single-threaded: no barrier to wait at"
    assert pair["scorer"].max_total_tokens == 8, "other settings are kept"
    three = share_cpu_cores({"generator": RuntimeConfig(), "scorer": RuntimeConfig(),
                             "target": RuntimeConfig(cpu_threads=3, env={"OMP_WAIT_POLICY": "ACTIVE"})}, cores=2)
    assert [(c.data_parallel, c.cpu_threads) for c in three.values()] == [(2, 1), (1, 1), (None, 3)], \
        "an explicit cpu_threads is kept"
    assert [c.env["OMP_WAIT_POLICY"] for c in three.values()] == ["PASSIVE", "PASSIVE", "ACTIVE"]
    small = share_cpu_cores({"generator": RuntimeConfig(max_total_tokens=16000)}, cores=2)["generator"]
    assert (small.data_parallel, small.cpu_threads) == (1, 1), "a budget below two ranks' minimum stays whole"
    own = share_cpu_cores({"generator": RuntimeConfig(data_parallel=3)}, cores=2)["generator"]
    assert (own.data_parallel, own.cpu_threads) == (3, 1), "an explicit data_parallel is kept"
    one = share_cpu_cores({"generator": RuntimeConfig(data_parallel=1)}, cores=2)["generator"]
    assert (one.data_parallel, one.cpu_threads) == (1, 1), "data_parallel: 1 keeps one process"
    gpu = {"generator": RuntimeConfig(device="cuda"), "scorer": RuntimeConfig()}
    planned = share_cpu_cores(gpu, cores=2)
    assert planned["generator"] == gpu["generator"] and planned["scorer"].cpu_threads == 1


def test_data_parallel_ranks_share_the_kv_budget_and_name_their_cores():
    from sgl_tts.runtime.server import RuntimeConfig, server_command, server_env

    config = RuntimeConfig(max_total_tokens=16384, data_parallel=2, cpu_threads=1)
    command = server_command(config, "/model", 1234)
    assert command[command.index("--dp-size") + 1] == "2"
    assert command[command.index("--max-total-tokens") + 1] == "8192", "the config's budget is the runtime's total"
    assert server_env(config)["SGLANG_CPU_OMP_THREADS_BIND"] == "0|1"
    assert server_env(RuntimeConfig(data_parallel=2, cpu_threads=2))["SGLANG_CPU_OMP_THREADS_BIND"] == "0-1|2-3"
    single = server_command(RuntimeConfig(max_total_tokens=100), "/model", 1234)
    assert "--dp-size" not in single and single[single.index("--max-total-tokens") + 1] == "100"
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in server_env(RuntimeConfig())


def test_a_multi_rank_cpu_runtime_places_whole_searches_on_its_ranks():
    from policies import search_placement
    from sgl_tts import env_names
    from sgl_tts.runtime.server import RuntimeConfig, server_command, server_env

    ranked = RuntimeConfig(data_parallel=2, cpu_threads=1)
    command = server_command(ranked, "/model", 1234)
    assert command[command.index("--load-balance-method") + 1] == "total_requests"  # the dispatcher the hook wraps
    assert command[command.index("--load-snapshot-publish-interval") + 1] == "1"
    assert server_env(ranked)[env_names.DP_PLACEMENT] == search_placement.SEARCH
    single = RuntimeConfig()
    assert "--load-balance-method" not in server_command(single, "/model", 1234)
    assert env_names.DP_PLACEMENT not in server_env(single)


def test_each_n_runs_at_a_fraction_of_its_working_set():
    from sgl_tts.bench.fasttts import cell_budget

    kv = {"generator": KV_FP32, "verifier": KV_FP32 // 2}
    # n = 64, B = 4, P = 80, 3 steps of 24: 80 + 16·48 + 64·24 = 2384 tokens per runtime
    cell = cell_budget(64, 0.5, 4, 80, 72, 24, kv)
    assert cell["working_set_tokens"] == {"generator": 2384, "verifier": 2384}
    whole_mib = 2384 * (KV_FP32 + KV_FP32 // 2) / MIB
    assert cell["working_set_mib"] == pytest.approx(whole_mib)
    assert cell["budget_mib"] == pytest.approx(0.5 * whole_mib) and not cell["raised_to_floors"]
    assert cell_budget(64, 1.0, 4, 80, 72, 24, kv)["budget_mib"] == pytest.approx(whole_mib)
    assert cell_budget(64, 0.5, 4, 80, 72, 24, kv, searches=3)["budget_mib"] == pytest.approx(1.5 * whole_mib)
    # n = 2 at a tenth: raised so that each static half holds the longest request (80 + 72 + 24 = 176 tokens)
    small = cell_budget(2, 0.1, 4, 80, 72, 24, kv)
    assert small["raised_to_floors"] and small["budget_mib"] == pytest.approx(2 * 176 * KV_FP32 / MIB)
    with pytest.raises(ValueError, match="positive"):
        cell_budget(16, 0.0, 4, 80, 72, 24, kv)


def test_the_bench_plans_for_the_longest_prompt_in_the_generators_format():
    from sgl_tts.bench.fasttts import longest_prompt_tokens
    from sgl_tts.frontend.backend import SYSTEM_PROMPT

    class WordTokenizer:  # no chat template: chat_prompt's plain format, one token per word
        def encode(self, text, add_special_tokens=True):
            return text.split()

    problems = [Problem("a", "What is 2 + 3?", "5"), Problem("b", "Tom has 4 apples and eats 1. How many left?", "3"),
                Problem("c", "1 + 1?", "2")]
    frame = len(f"{SYSTEM_PROMPT}\n\nQuestion: \n\nAnswer:\n".split())
    assert longest_prompt_tokens(problems, None, WordTokenizer()) == frame + 10, "the longest, with its frame"


def test_runs_of_one_n_each_merge_into_one_table_and_plot(monkeypatch, tmp_path, capsys):
    """`--merge`: the JSON of separate runs (one per n, so that one n's runtimes are alive at a time) reported
    together; a cell measured in two files pools its runs; a file that is not a bench JSON is named."""
    import json

    from sgl_tts.bench import fasttts

    def run_cell(pool, config, problems, describe):
        n = config.search.n
        return {"goodput": 100.0 / n + (1.0 if config.fasttts.label != "baseline" else 0.0),
                "p50_latency_s": float(n), "verifier_share": 0.1, "verifier_cache_hit": 0.5,
                "evicted_tokens": 0.0, "retracted": 0.0, "speculation": {}, "planned_verifier_hit": 0.7,
                "errors": 0}

    monkeypatch.setattr(fasttts, "run_cell", run_cell)
    for n in (16, 64):
        fasttts.run_bench(fasttts.BenchOptions(programs="beam_search", ns=str(n), arms="baseline,P", repeats=2,
                                               problems=1, prompt_tokens=80, out=str(tmp_path / f"n{n}")))
    files = [str(tmp_path / f"n{n}" / "bench-fasttts.json") for n in (16, 64, 64)]
    capsys.readouterr()
    assert fasttts.run_bench(fasttts.BenchOptions(merge=",".join(files), out=str(tmp_path / "all"))) == 0
    printed = capsys.readouterr().out
    assert "merged from" in printed and "PARTIAL" not in printed
    merged = json.loads((tmp_path / "all" / "bench-fasttts.json").read_text())
    runs = {(c["n"], c["arm"]): len(c["runs"]) for c in merged["cells"]}
    assert runs == {(16, "baseline"): 2, (16, "P"): 2, (64, "baseline"): 4, (64, "P"): 4}, "n = 64 given twice"
    assert sorted(b["n"] for b in merged["budgets"]) == [16, 64] and merged["merged_from"] == files
    assert (tmp_path / "all" / "bench-fasttts.png").stat().st_size > 0
    table = (tmp_path / "all" / "bench-fasttts.md").read_text()
    assert table.count("| beam_search |") == 4 and "merged from" in table
    (tmp_path / "bad.json").write_text('{"cells": []}')
    with pytest.raises(ValueError, match="bad.json: not a bench fasttts JSON"):
        fasttts.run_bench(fasttts.BenchOptions(merge=str(tmp_path / "bad.json")))
    (tmp_path / "empty.json").write_text('{"protocol": "p", "cells": []}')
    with pytest.raises(ValueError, match="empty.json: no measured cell"):
        fasttts.run_bench(fasttts.BenchOptions(merge=str(tmp_path / "empty.json")))


def test_a_bench_stopped_by_an_error_keeps_the_cells_it_measured(monkeypatch, tmp_path, capsys):
    """A runtime that fails mid-way (a start-up error, a crash) loses no measured cell: the table of what was
    measured is printed and written, marked partial, and the error still ends the run."""
    import json

    from sgl_tts.bench import fasttts

    row = {"goodput": 1.0, "p50_latency_s": 2.0, "verifier_share": 0.1, "verifier_cache_hit": 0.5,
           "evicted_tokens": 0.0, "retracted": 0.0, "speculation": {}, "planned_verifier_hit": 0.7,
           "errors": 0}
    calls = []

    def run_cell(pool, config, problems, describe):
        calls.append(config.fasttts)
        if len(calls) == 3:
            raise RuntimeError("runtime 'verifier' was not ready")
        return dict(row)

    monkeypatch.setattr(fasttts, "run_cell", run_cell)
    options = fasttts.BenchOptions(programs="beam_search", ns="16", arms="baseline,P", repeats=2, problems=1,
                                   prompt_tokens=80, out=str(tmp_path))
    with pytest.raises(RuntimeError, match="not ready"):
        fasttts.run_bench(options)
    printed = capsys.readouterr().out
    assert "stopped by an error" in printed and "PARTIAL" in printed
    written = json.loads((tmp_path / "bench-fasttts.json").read_text())
    assert written["partial"] is True
    assert sorted((c["arm"], len(c["runs"])) for c in written["cells"]) == [("P", 1), ("baseline", 1)]
    assert "PARTIAL" in (tmp_path / "bench-fasttts.md").read_text()
