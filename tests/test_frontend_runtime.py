"""A plain SGLang program (docs/examples/step_vote.py) on a real CPU runtime with the prefix-aware policy:
its tokens are the server's own count, its forks hit the radix cache, and the scheduler groups its siblings."""

import json
import re
from pathlib import Path

import pytest

from policies.base import decode_rid
from sgl_tts.problems import Problem

pytestmark = pytest.mark.runtime

STEP_VOTE = str(Path(__file__).resolve().parents[1] / "docs" / "examples" / "step_vote.py")


def generated_tokens_served(runtime) -> float:
    """The server's own counter of generated tokens (Prometheus, --enable-metrics)."""
    import urllib.request

    text = urllib.request.urlopen(runtime.url + "/metrics", timeout=30).read().decode()
    return sum(float(m.group(1)) for m in re.finditer(r"^sglang:generation_tokens_total\{[^}]*\} (\S+)$", text, re.M))


def test_a_plain_program_is_tagged_accounted_and_grouped_by_the_scheduler(policy_runtime):
    from transformers import AutoTokenizer

    from sgl_tts.frontend.backend import TTSEndpoint, chat_prompt
    from sgl_tts.search.api import Runtimes, SearchConfig
    from sgl_tts.search.programs import load_program

    runtime, trace = policy_runtime
    tokenizer = AutoTokenizer.from_pretrained(runtime.model_path)
    generator = TTSEndpoint(runtime)
    reported = []  # completion_tokens of every request, as the server's meta_info gave it
    runtimes = Runtimes(generator=generator, scorer=None, prompt=lambda q: chat_prompt(tokenizer, q))
    config = SearchConfig(n=4, max_steps=3, max_step_tokens=8, max_tokens=24, temperature=1.0)
    context = runtimes.new_search(config, "vote", observers=[lambda request: reported.append(request.completion_tokens)])
    before = generated_tokens_served(runtime)
    result = load_program(STEP_VOTE)(Problem(id="vote", question="What is 2 + 3?", gold="5"), config, runtimes,
                                     context)
    assert result.generated_tokens == sum(reported) > 0, "the server's own per-request counts, every request"
    # The server-wide counter (Prometheus) saw at least as many: nothing is counted that was not generated.
    assert generated_tokens_served(runtime) - before >= result.generated_tokens
    assert result.cached_tokens > 0, "the forks' shared prefix is served from the radix cache"
    assert result.candidates and result.candidates[0].tokens > 0 and result.precise_goodput > 0

    # With one running slot, the forks of each round wait together; the policy keeps siblings contiguous.
    ours = [[decode_rid(rid) for rid in line["rids"]] for line in map(json.loads, trace.read_text().splitlines())]
    ours = [[t for t in line if t is not None and t.problem_id.startswith("vote/")] for line in ours]
    queued = [line for line in ours if len(line) >= 2]
    assert queued, "some of the program's forks waited in the queue the policy ordered"
    for line in queued:
        groups = [(t.iteration, t.parent_id) for t in line]
        runs = [g for i, g in enumerate(groups) if i == 0 or g != groups[i - 1]]
        assert len(runs) == len(set(runs)), f"siblings are contiguous: {groups}"
