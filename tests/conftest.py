import pytest


def pytest_collection_modifyitems(config, items):
    # Runtime tests share one SGLang start-up per session; run them after the fast tier.
    items.sort(key=lambda item: item.get_closest_marker("runtime") is not None)


@pytest.fixture(scope="session")
def tiny_runtime(tmp_path_factory):
    """One real SGLang CPU runtime serving the tiny random-weight model, shared by the runtime tests."""
    from sgl_tts.runtime.server import Runtime, RuntimeConfig

    runtime = Runtime.start(RuntimeConfig(model="tiny-random", max_total_tokens=16384, startup_timeout_s=600),
                            name="tiny", log_dir=tmp_path_factory.mktemp("runtime-logs"))
    yield runtime
    runtime.stop()


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
    """A tiny-model runtime with SGL_TTS_POLICY=prefix, metrics on, and one request running at a time, so
    that every other request waits in the queue the policy orders (each reordering is traced to a file)."""
    from sgl_tts.runtime.server import Runtime, RuntimeConfig

    folder = tmp_path_factory.mktemp("policy-runtime")
    trace = folder / "trace.jsonl"
    config = RuntimeConfig(model="tiny-random", max_total_tokens=4096, max_running_requests=1,
                           startup_timeout_s=600, extra_args=["--schedule-policy", "fcfs", "--enable-metrics"],
                           env={"SGL_TTS_POLICY": "prefix", "SGL_TTS_POLICY_TRACE": str(trace)})
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
