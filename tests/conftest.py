import os

import pytest

from sgl_tts import env_names

# The runtimes the tests start compute their linear layers in fp32 on every CPU, so that tests comparing a
# runtime with transformers' fp32 model hold to fp32's tolerances; a CPU with AMX would otherwise run them in bf16
# (sgl_tts/runtime/server.py). tests/test_cpu_linear.py starts a bf16 runtime of its own.
os.environ.setdefault(env_names.CPU_LINEAR, "packed")


@pytest.fixture(autouse=True)
def no_prestarted_zygote(monkeypatch):
    """`run`, `serve` and `eval` start the CPU runtimes' zygote before their imports (`prestart_cpu_zygote`); the
    tests that call them in this process start none (tests/test_zygote.py and tests/test_cli.py test it)."""
    from sgl_tts.runtime import server

    monkeypatch.setattr(server, "prestart_cpu_zygote", lambda: None)


def pytest_collection_modifyitems(config, items):
    # Runtime tests share one SGLang start-up per session; run them after the fast tier.
    items.sort(key=lambda item: item.get_closest_marker("runtime") is not None)


@pytest.fixture(scope="session")
def tiny_probe_head(tmp_path_factory):
    """A random probe head on the tiny model's layer 1 (of 2), mean-pooled: the head file tiny_runtime computes
    margins of (policies/probe_readout.py)."""
    import torch

    from sgl_tts.scoring.probe import ProbeHead

    weight = (torch.randn(64, generator=torch.Generator().manual_seed(7)) / 8).tolist()
    head = ProbeHead(base_model="tiny-random", layer=1, pooling="mean", weight=tuple(weight), bias=-0.2)
    return head.save(tmp_path_factory.mktemp("probe-head") / "tiny-head.json")


@pytest.fixture(scope="session")
def tiny_runtime(tmp_path_factory, tiny_probe_head):
    """One real SGLang CPU runtime serving the tiny random-weight model, shared by the runtime tests; started as a
    session with the probe read inside the generator starts it (with a head, `tiny_probe_head`)."""
    from sgl_tts import env_names
    from sgl_tts.runtime.server import Runtime, RuntimeConfig

    runtime = Runtime.start(RuntimeConfig(model="tiny-random", max_total_tokens=16384, startup_timeout_s=600,
                                          env={env_names.PROBE_HEAD: str(tiny_probe_head)}),
                            name="tiny", log_dir=tmp_path_factory.mktemp("runtime-logs"))
    yield runtime
    runtime.stop()


@pytest.fixture(scope="session")
def tiny_grid_model(tiny_runtime, tmp_path_factory):
    """(folder, fp32 model): the tiny model with every decoder linear weight put on a Q4_1 grid and its embedding
    (its tied LM head) on a Q8_0 grid, as a GGUF file's converted weights are, saved with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from policies import cpu_linear

    if cpu_linear.grid_kernels() is None:
        pytest.skip("no compiler for the grid kernel")
    model = AutoModelForCausalLM.from_pretrained(tiny_runtime.model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".layers." in name and parameter.dim() == 2:
                parameter.copy_(cpu_linear.q4_1_round(parameter))
                assert cpu_linear.grid_tiles(parameter) is not None
        embedding = model.get_input_embeddings().weight
        embedding.copy_(cpu_linear.q8_0_round(embedding))
        assert cpu_linear.grid_bits(cpu_linear.grid_tiles(embedding)) == 8
    folder = tmp_path_factory.mktemp("tiny-quantized")
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_runtime.model_path).save_pretrained(folder)
    return folder, model


@pytest.fixture(scope="session")
def tiny_search_runtimes(tiny_runtime):
    """Runtimes for search programs: generator and likelihood scorer both on the tiny runtime."""
    from transformers import AutoTokenizer

    from sgl_tts.frontend.backend import TTSEndpoint, chat_prompt
    from sgl_tts.scoring.likelihood import LikelihoodScorer
    from sgl_tts.search.api import Runtimes

    tokenizer = AutoTokenizer.from_pretrained(tiny_runtime.model_path)
    return Runtimes(generator=TTSEndpoint(tiny_runtime), scorer=LikelihoodScorer(tiny_runtime, tokenizer),
                    prompt=lambda question: chat_prompt(tokenizer, question))


@pytest.fixture(scope="session")
def policy_runtime(tmp_path_factory):
    """A tiny-model runtime with SGLTTS_POLICY=prefix, metrics on, and one request running at a time, so
    that every other request waits in the queue the policy orders (each reordering is traced to a file)."""
    from sgl_tts import env_names
    from sgl_tts.runtime.server import Runtime, RuntimeConfig

    folder = tmp_path_factory.mktemp("policy-runtime")
    trace = folder / "trace.jsonl"
    config = RuntimeConfig(model="tiny-random", max_total_tokens=4096, max_running_requests=1,
                           startup_timeout_s=600, extra_args=["--schedule-policy", "fcfs", "--enable-metrics"],
                           env={env_names.POLICY: "prefix", env_names.POLICY_TRACE: str(trace)})
    runtime = Runtime.start(config, name="policy", log_dir=folder)
    yield runtime, trace
    runtime.stop()


@pytest.fixture(scope="session")
def priority_runtime(tmp_path_factory):
    """A tiny-model runtime started with the settings FastTTS's P and S give the generator (the plugin's
    prefix policy, priority scheduling), one request running at a time so a new one must preempt to run."""
    import dataclasses

    from sgl_tts.fasttts.switches import FastTTSConfig, configure_runtimes
    from sgl_tts.runtime.server import Runtime, RuntimeConfig
    from sgl_tts.search.api import SearchConfig

    fast = FastTTSConfig(prefix_order=True, speculative=True)
    generator = RuntimeConfig(model="tiny-random", max_total_tokens=4096, startup_timeout_s=600)
    settings = configure_runtimes(fast, SearchConfig(), generator, None)
    config = dataclasses.replace(settings.generator, max_running_requests=1)
    runtime = Runtime.start(config, name="priority", log_dir=tmp_path_factory.mktemp("priority-runtime"))
    yield runtime, fast
    runtime.stop()


@pytest.fixture(scope="session")
def tiny_prm(tmp_path_factory):
    """A tiny random-weight Qwen2.5-Math-PRM-shaped checkpoint (seed 0), built once into a temporary folder."""
    from sgl_tts.scoring.prm_models.tiny import build_tiny_prm

    return build_tiny_prm(tmp_path_factory.mktemp("tiny-prm"), seed=0)


@pytest.fixture(scope="session")
def tiny_prm_runtime(tiny_prm, tmp_path_factory):
    """The tiny PRM served as a step classifier on the runtime `classifier_runtime_config` describes (embedding
    mode, our model class through SGLANG_EXTERNAL_MODEL_PACKAGE, no radix cache), shared by the PRM tests."""
    from sgl_tts.runtime.server import Runtime, group_members
    from sgl_tts.scoring.prm import classifier_runtime_config

    runtime = Runtime.start(classifier_runtime_config(str(tiny_prm)), name="prm",
                            log_dir=tmp_path_factory.mktemp("prm-logs"))
    yield runtime
    runtime.stop()
    assert not group_members(runtime.process.pid), f"PRM runtime left processes behind: {runtime.log_path}"
