"""The probe PRM: head files, the checkpoint that folds the head into an LM head, training, and its scorer.

References: the features the head is trained on (`extract_features`, hooks on a transformers model), the
built checkpoint run by transformers, a gradient check for the logistic fit, and (runtime tier) the scorer on
a real SGLang CPU runtime. All on the tiny random-weight Llama, with a random head.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sgl_tts.scoring.scorer_config import ScorerConfig
from sgl_tts.scoring.probe import (PROBE_FILE, ProbeHead, ProbeScorer, build_probe_checkpoint, readout_positions,
                                   step_spans, whole_text_spans)
from sgl_tts.scoring.probe_train import extract_features, fit_logistic, load_features
from sgl_tts.scoring.step_labels import LabelledSolution

TOLERANCE = 1e-4  # fp32 on both sides
# A generator's margins against transformers' fp32: its KV pool is bf16 (the CPU default), keys and values rounded to
# 8 significant bits, which moved this tiny model's margins (w·h, of order 1) by up to 1.6e-3 and its step scores by
# up to 2e-4; a margin read from another token's slot is off by a tenth or more.
POOL_TOLERANCE = 1e-2
SOLUTIONS = [
    LabelledSolution("a", "Tom has 3 apples and buys 4 more. How many?", ("Tom starts with 3.", "3 + 4 = 7.",
                                                                         "The answer is 7."), -1),
    LabelledSolution("b", "What is 2 + 2?", ("2 + 2 = 5.", "So the answer is 5."), -1),
]


@pytest.fixture(scope="module")
def base_dir():
    from sgl_tts.runtime.models import resolve_model

    return resolve_model("tiny-random")


@pytest.fixture(scope="module")
def tokenizer(base_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base_dir)


def random_head(layer: int, pooling: str, hidden: int = 64, seed: int = 0) -> ProbeHead:
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(hidden, generator=generator) / hidden**0.5).tolist()
    return ProbeHead(base_model="tiny-random", layer=layer, pooling=pooling, weight=tuple(weight), bias=0.3)


@pytest.fixture(scope="module")
def checkpoint(base_dir, tmp_path_factory):
    return build_probe_checkpoint(random_head(1, "last"), base_dir, tmp_path_factory.mktemp("probe"))


def reference_scores(base_dir, head: ProbeHead, tmp_path: Path) -> list[list[float]]:
    """sigmoid(w·feature + b) from the training features of each solution's steps."""
    extract_features(base_dir, SOLUTIONS, [head.layer], tmp_path, progress=False)
    features = load_features(SOLUTIONS, [head.layer], tmp_path)
    logits = features.pooled[(head.pooling, head.layer)] @ np.array(head.weight) + head.bias
    scores = 1 / (1 + np.exp(-logits))
    return [scores[features.solution == i].tolist() for i in range(len(SOLUTIONS))]


def token_margins(base_dir, head: ProbeHead, ids: list[int]) -> list[float]:
    """w·RMSNorm(h) per position, h transformers' residual stream after head.layer layers, the norm the model's
    final one: what a generator rank keeps per token (policies/probe_readout.py)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[head.layer][0].double()
        normed = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + model.config.rms_norm_eps)
        return (normed * model.model.norm.weight.double() @ torch.tensor(head.weight, dtype=torch.float64)).tolist()


def generator_reference(base_dir, head: ProbeHead, tokenizer, prompt: str, steps: list[str]) -> list[float]:
    """Each step's score read inside the generator, by brute force: the whole text tokenized once, each token given
    to the step whose characters hold its first character, sigmoid(mean margin of the step's tokens + b)."""
    encoded = tokenizer(prompt + "".join(steps), add_special_tokens=False, return_offsets_mapping=True)
    margins = token_margins(base_dir, head, encoded.input_ids)
    bounds = np.cumsum([len(prompt)] + [len(step) for step in steps])
    owner = [int(np.searchsorted(bounds, begin, side="right")) for begin, _ in encoded.offset_mapping]  # 0: prompt
    scores = []
    for k in range(1, len(steps) + 1):
        positions = [p for p, o in enumerate(owner) if o == k] or [max(p for p, o in enumerate(owner) if o < k)]
        if head.pooling == "last":
            positions = positions[-1:]
        scores.append(1 / (1 + math.exp(-(sum(margins[p] for p in positions) / len(positions) + head.bias))))
    return scores


class MarginGenerator:
    """A generator started with a probe head, as the scorer sees it: /generate answers each request's margins
    (computed by transformers, `token_margins`) in meta_info, and the requests are recorded."""

    name, url = "generator", "http://fake"

    def __init__(self, base_dir, head: ProbeHead, answer_margins: bool = True):
        self.model_path, self.head, self.answer_margins = str(base_dir), head, answer_margins
        self.requests: list[dict] = []

    def check_alive(self):
        pass

    def generate(self, payload: dict) -> list[dict]:
        from policies.probe_readout import META_KEY

        self.requests.append(payload)
        assert payload["sampling_params"]["max_new_tokens"] == 1
        return [{"meta_info": {"prompt_tokens": len(ids), "cached_tokens": len(ids) - 1,
                               **({META_KEY: [token_margins(self.model_path, self.head, ids)]}
                                  if self.answer_margins else {})}}
                for ids in payload["input_ids"]]


# --- fast tier -----------------------------------------------------------------------------------------

def test_head_file_round_trips_and_refuses_bad_values(tmp_path):
    head = random_head(2, "mean")
    assert ProbeHead.load(head.save(tmp_path / "h.json")) == head
    with pytest.raises(ValueError, match="pooling"):
        ProbeHead(base_model="x", layer=1, pooling="max", weight=(1.0,), bias=0.0)
    with pytest.raises(ValueError, match="finite"):
        ProbeHead(base_model="x", layer=1, pooling="last", weight=(float("nan"),), bias=0.0)
    (tmp_path / "bad.json").write_text(json.dumps({"layer": 1}))
    with pytest.raises(ValueError, match="bad.json"):
        ProbeHead.load(tmp_path / "bad.json")


def test_step_spans_cover_each_step_and_extend_as_a_prefix(tokenizer):
    ids, spans = step_spans(tokenizer, "Q: ", ["one\n\n", "two"])
    assert [tokenizer.decode(ids[a:b]) for a, b in spans] == ["one\n\n", "two"]
    longer, _ = step_spans(tokenizer, "Q: ", ["one\n\n", "two", " three"])
    assert longer[:len(ids)] == ids
    assert list(readout_positions((3, 6), "last")) == [5] and list(readout_positions((3, 6), "mean")) == [3, 4, 5]
    ids, spans = step_spans(tokenizer, "Q: ", ["one", ""])  # an empty step reads the token before it
    assert spans[1] == (len(ids), len(ids))
    assert all(list(readout_positions(spans[1], pooling)) == [len(ids) - 1] for pooling in ("last", "mean"))
    with pytest.raises(ValueError, match="step 0 is empty and nothing comes before it"):
        step_spans(tokenizer, "", [""])


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_checkpoint_logit_difference_equals_the_head_on_training_features(base_dir, tmp_path, pooling):
    """Transformers runs the built checkpoint; w·h read as logit(+) - logit(-) matches the head on the features."""
    from transformers import AutoModelForCausalLM

    from sgl_tts.frontend.backend import chat_prompt

    head = random_head(1, pooling)
    folder = build_probe_checkpoint(head, base_dir, tmp_path / "ckpt")
    probe = json.loads((folder / PROBE_FILE).read_text())
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert model.config.num_hidden_layers == 1 and not model.config.tie_word_embeddings
    expected = reference_scores(base_dir, head, tmp_path / "features")
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(folder)
    for solution, want in zip(SOLUTIONS, expected):
        ids, spans = step_spans(tokenizer, chat_prompt(tokenizer, solution.problem), solution.search_steps())
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        margin = logits[:, probe["positive_token_id"]] - logits[:, probe["negative_token_id"]]
        got = [1 / (1 + math.exp(-(float(margin[list(readout_positions(s, pooling))].mean()) + probe["bias"])))
               for s in spans]
        assert got == pytest.approx(want, abs=TOLERANCE)


def test_checkpoint_refuses_a_head_that_does_not_fit(base_dir, tmp_path):
    with pytest.raises(ValueError, match="outside 1..2"):
        build_probe_checkpoint(random_head(3, "last"), base_dir, tmp_path)
    with pytest.raises(ValueError, match="hidden size 64"):
        build_probe_checkpoint(random_head(1, "last", hidden=8), base_dir, tmp_path)


def test_logistic_fit_is_a_stationary_point_and_deterministic():
    rng = np.random.default_rng(0)
    x = rng.normal(3.0, 2.0, size=(200, 5))
    y = (x[:, 0] - 3 + rng.normal(size=200) > 0).astype(float)
    l2 = 1e-2
    w, b = fit_logistic(x, y, l2)
    assert fit_logistic(x, y, l2)[0].tolist() == w.tolist()
    # Gradient of mean BCE + l2/2 |v|^2 in the standardised coordinates v = w * sd.
    mu, sd = x.mean(0), x.std(0) + 1e-8
    z = (x - mu) / sd
    p = 1 / (1 + np.exp(-(x @ w + b)))
    grad_v = z.T @ (p - y) / len(y) + l2 * (w * sd)
    assert np.abs(grad_v).max() < 1e-6 and abs((p - y).mean()) < 1e-6
    assert w[0] > 0 and np.abs(w[1:]).max() < w[0] / 3


class FakeRuntime:
    """A /generate that answers like SGLang from the checkpoint run by transformers, and records requests."""

    name, url = "probe", "http://fake"

    def __init__(self, folder: Path):
        from transformers import AutoModelForCausalLM

        self.model_path = str(folder)
        self.model = AutoModelForCausalLM.from_pretrained(folder).eval()
        self.requests: list[dict] = []

    def check_alive(self):
        pass

    def generate(self, payload: dict) -> list[dict] | dict:
        self.requests.append(payload)
        if "logprob_start_len" not in payload:  # the shared prefix alone, to be cached (_prefill_shared_prefix)
            return {"meta_info": {"prompt_tokens": len(payload["input_ids"]), "cached_tokens": 0}}
        answers = []
        for ids, start in zip(payload["input_ids"], payload["logprob_start_len"]):
            with torch.no_grad():
                logprobs = torch.log_softmax(self.model(torch.tensor([ids])).logits[0], dim=-1)
            wanted = payload["token_ids_logprob"]
            row = lambda p: [[float(logprobs[p, t]), t, None] for t in wanted]  # noqa: E731
            # entry j predicts token start + j, i.e. the distribution at position start + j - 1
            answers.append({"meta_info": {
                "input_token_ids_logprobs": [None if start + j == 0 else row(start + j - 1)
                                             for j in range(len(ids) - start)],
                "output_token_ids_logprobs": [row(len(ids) - 1)], "cached_tokens": 0}})
        return answers


def test_scorer_reads_each_step_once_and_matches_the_reference(checkpoint, base_dir, tokenizer, tmp_path, monkeypatch):
    from sgl_tts.frontend.backend import chat_prompt

    runtime = FakeRuntime(checkpoint)
    monkeypatch.setattr("sgl_tts.scoring.runtime_calls.http_json", lambda url, payload, timeout: runtime.generate(payload))
    scorer = ProbeScorer(ScorerConfig(kind="probe"), runtime, tokenizer)
    expected = reference_scores(base_dir, random_head(1, "last"), tmp_path)
    solution = SOLUTIONS[0]
    prompt = chat_prompt(tokenizer, solution.problem)
    steps = solution.search_steps()
    assert scorer.score(prompt, [steps[:2]]) == [pytest.approx(expected[0][:2], abs=TOLERANCE)]
    assert scorer.score(prompt, [steps, steps[:1]]) == [pytest.approx(expected[0], abs=TOLERANCE),
                                                       pytest.approx(expected[0][:1], abs=TOLERANCE)]
    # The second call asked only for the new step: one path, logprobs from its last token on.
    ids, spans = step_spans(tokenizer, prompt, steps)
    assert [len(r["input_ids"]) for r in runtime.requests] == [1, 1]
    assert runtime.requests[1]["logprob_start_len"] == [spans[2][1] - 1]
    assert scorer.score(prompt, [steps]) == [pytest.approx(expected[0], abs=TOLERANCE)]
    assert len(runtime.requests) == 2, "a path scored before needs no request"
    # An empty step (the generator stopped at once) reads the token before it: with last-token pooling,
    # the same score as the step before.
    (empty,) = scorer.score(prompt, [steps[:1] + [""]])
    assert empty == [pytest.approx(expected[0][0], abs=TOLERANCE)] * 2


def test_paths_read_from_their_start_together_are_sent_after_their_shared_prefix_alone(checkpoint, tokenizer, monkeypatch):
    from sgl_tts.frontend.backend import chat_prompt

    runtime = FakeRuntime(checkpoint)
    monkeypatch.setattr("sgl_tts.scoring.runtime_calls.http_json", lambda url, payload, timeout: runtime.generate(payload))
    scorer = ProbeScorer(ScorerConfig(kind="probe"), runtime, tokenizer)
    solution = SOLUTIONS[0]
    prompt = chat_prompt(tokenizer, solution.problem)
    steps = solution.search_steps()
    alone = [scorer.score(prompt, [steps[:k]])[0] for k in (1, 2)]  # one path: nothing to share, no prompt request
    assert all("logprob_start_len" in r for r in runtime.requests)
    runtime.requests.clear()
    fresh = ProbeScorer(ScorerConfig(kind="probe"), runtime, tokenizer)
    counted = fresh.score_counted(prompt, [steps[:1], steps[:2]])
    assert counted.scores == [pytest.approx(a, abs=1e-9) for a in alone], "the scores do not change"
    prompt_request, batch = runtime.requests
    shared = step_spans(tokenizer, prompt, steps[:1])[0]  # the prompt and the first step: both paths start so
    assert prompt_request["input_ids"] == shared and "logprob_start_len" not in prompt_request
    assert len(batch["input_ids"]) == 2 and counted.counts.requests == 3
    assert counted.counts.input_tokens == len(prompt_request["input_ids"]) + sum(map(len, batch["input_ids"]))
    runtime.requests.clear()
    fresh.score(prompt, [steps[:3], steps[:3] + [" and on"]])  # both paths extend scored ones: no prompt request
    assert len(runtime.requests) == 1


def test_scorer_refuses_a_model_without_probe_file(tmp_path, tokenizer):
    from sgl_tts.runtime.server import RuntimeConfig

    with pytest.raises(ValueError, match=PROBE_FILE):  # a scorer runtime of its own must serve a checkpoint
        ProbeScorer(ScorerConfig(kind="probe", runtime=RuntimeConfig()),
                    SimpleNamespace(model_path=str(tmp_path), name="x", url="u"), tokenizer)


def test_whole_text_spans_give_each_token_to_the_step_it_begins_in(tokenizer):
    prompt = "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n"
    steps = ["Step 1: 3 + 4 = 7.\n\n", "", "Step 2: so the answer is 7.\n\n", "  The end"]
    encoded = tokenizer(prompt + "".join(steps), add_special_tokens=False, return_offsets_mapping=True)
    ids, spans = whole_text_spans(tokenizer, prompt, steps)
    assert ids == encoded.input_ids, "the ids are the whole text's, as a runtime tokenizes a request's text"
    bounds = np.cumsum([len(prompt)] + [len(step) for step in steps])
    for k, (start, end) in enumerate(spans):  # brute force: every token whose first character is in step k
        inside = [p for p, (begin, _) in enumerate(encoded.offset_mapping) if bounds[k] <= begin < bounds[k + 1]]
        assert list(range(start, end)) == inside, (k, steps[k])
    assert spans[1][0] == spans[1][1] and spans[-1][1] == len(ids) and spans[0][0] > 0


def test_probe_read_inside_the_generator_scores_new_steps_from_its_margins(base_dir, tokenizer, tmp_path,
                                                                           monkeypatch):
    from policies.base import decode_rid
    from sgl_tts.frontend.backend import chat_prompt
    from sgl_tts.scoring.base import ScorerError, scoring_run

    head = random_head(1, "mean", seed=3)
    runtime = MarginGenerator(base_dir, head)
    monkeypatch.setattr("sgl_tts.scoring.runtime_calls.http_json", lambda url, payload, timeout: runtime.generate(payload))
    config = ScorerConfig(kind="probe", probe_head=str(head.save(tmp_path / "head.json")))
    scorer = ProbeScorer(config, runtime, tokenizer)
    prompt, steps = chat_prompt(tokenizer, SOLUTIONS[0].problem), SOLUTIONS[0].search_steps()
    with scoring_run("search/run-1"):
        first = scorer.score(prompt, [steps[:1]])[0]
        full = scorer.score_counted(prompt, [steps, steps[:2]])
    # step 1 was scored on its own path, the others on the whole path (a text's last token can part from the same
    # text's tokens with more after it)
    expected = (generator_reference(base_dir, head, tokenizer, prompt, steps[:1])
                + generator_reference(base_dir, head, tokenizer, prompt, steps)[1:])
    assert full.scores[0] == pytest.approx(expected, abs=TOLERANCE)
    assert full.scores[1] == pytest.approx(expected[:1] + generator_reference(base_dir, head, tokenizer, prompt,
                                                                               steps[:2])[1:], abs=TOLERANCE)
    assert first == full.scores[0][:1] == full.scores[1][:1], "the memo's scores are kept"
    assert [len(r["input_ids"]) for r in runtime.requests] == [1, 2]
    assert runtime.requests[1]["input_ids"][0] == whole_text_spans(tokenizer, prompt, steps)[0]
    assert {decode_rid(rid).problem_id for r in runtime.requests for rid in r["rid"]} == {"search/run-1"}
    assert len({rid for r in runtime.requests for rid in r["rid"]}) == 3, "request ids stay unique"
    assert full.counts.requests == 2 and full.counts.cached_tokens == sum(
        len(ids) - 1 for ids in runtime.requests[1]["input_ids"])
    runtime.requests.clear()
    scorer.score(chat_prompt(tokenizer, SOLUTIONS[1].problem), [SOLUTIONS[1].search_steps()])
    assert "rid" not in runtime.requests[0], "outside a run the requests go untagged (the least busy rank)"
    last = ProbeScorer(ScorerConfig(kind="probe", probe_head=str(random_head(1, "last", seed=3).save(
        tmp_path / "last.json"))), runtime, tokenizer)
    assert last.score(prompt, [steps])[0] == pytest.approx(generator_reference(
        base_dir, random_head(1, "last", seed=3), tokenizer, prompt, steps), abs=TOLERANCE)
    runtime = MarginGenerator(base_dir, head, answer_margins=False)  # a generator started without the head
    mute = ProbeScorer(config, runtime, tokenizer)
    with pytest.raises(ScorerError, match="returned no probe margins.*SGLTTS_PROBE_HEAD"):
        mute.score(prompt, [steps])


def test_a_probe_inside_the_generator_starts_it_with_the_head(tmp_path):
    from sgl_tts import env_names
    from sgl_tts.runtime.server import RuntimeConfig
    from sgl_tts.scoring.probe import DEFAULT_HEAD, generator_with_probe

    generator = RuntimeConfig(env={"A": "1"})
    assert generator_with_probe(generator, ScorerConfig(kind="probe")).env == {
        "A": "1", env_names.PROBE_HEAD: str(DEFAULT_HEAD.resolve())}
    head = random_head(1, "mean").save(tmp_path / "h.json")
    assert generator_with_probe(generator, ScorerConfig(kind="probe", probe_head=str(head))).env[
        env_names.PROBE_HEAD] == str(head.resolve())
    for scorer in (ScorerConfig(kind="probe", runtime=RuntimeConfig(model="smollm2-135m-probe")),
                   ScorerConfig(kind="likelihood")):
        assert generator_with_probe(generator, scorer) is generator
    with pytest.raises(ValueError, match="not a probe head file"):
        generator_with_probe(generator, ScorerConfig(kind="probe", probe_head=str(tmp_path / "missing.json")))
    with pytest.raises(ValueError, match="probe_head applies to kind probe without a runtime"):
        ScorerConfig(kind="likelihood", probe_head="x")


# --- runtime tier --------------------------------------------------------------------------------------

@pytest.mark.runtime
def test_sglang_serves_the_probe_like_the_reference_with_radix_reuse(checkpoint, base_dir, tokenizer, tmp_path):
    from sgl_tts.frontend.backend import chat_prompt
    from sgl_tts.runtime.server import Runtime, RuntimeConfig

    expected = reference_scores(base_dir, random_head(1, "last"), tmp_path / "features")
    with Runtime.start(RuntimeConfig(model=str(checkpoint), max_total_tokens=8192), name="probe",
                       log_dir=tmp_path / "logs") as runtime:
        scorer = ProbeScorer(ScorerConfig(kind="probe"), runtime, tokenizer)
        prompts = [chat_prompt(tokenizer, s.problem) for s in SOLUTIONS]
        paths = [s.search_steps() for s in SOLUTIONS]
        first = [scorer.score(p, [steps[:1]])[0] for p, steps in zip(prompts, paths)]
        cached_before = scorer.tokens_cached
        full = [scorer.score(p, [steps])[0] for p, steps in zip(prompts, paths)]
        assert full == [pytest.approx(e, abs=TOLERANCE) for e in expected]
        assert [f[:1] for f in full] == first
        assert scorer.tokens_cached - cached_before > 0, "the extended paths should reuse the cached prefix"
        # Paths of a new prompt scored together: with the prompt sent alone first, every path finds it cached;
        # sent in one batch without it, the paths are scheduled together and each computes the prompt again.
        batch = [[f"Path {k}: " + SOLUTIONS[0].search_steps()[0]] for k in range(4)]
        uncached = ProbeScorer(ScorerConfig(kind="probe"), runtime, tokenizer)
        uncached._prefill_shared_prefix = lambda id_lists, first_new, generate, counts: None
        together = uncached.score_counted("Solve it once more: " + prompts[0], batch).counts
        warmed = scorer.score_counted("And solve it again: " + prompts[0], batch).counts
        question = len(step_spans(tokenizer, "And solve it again: " + prompts[0], [])[0])
        assert warmed.requests == together.requests + 1 == 5
        assert warmed.cached_tokens >= 4 * (question - 1), (warmed, question)
        assert together.cached_tokens < warmed.cached_tokens, (together, warmed)
        print(f"4 paths of a new {question}-token prompt: cached {together.cached_tokens} of "
              f"{together.input_tokens} in one batch, {warmed.cached_tokens} of {warmed.input_tokens} after it alone")
        mean_scorer = ProbeScorer(ScorerConfig(kind="probe"), runtime, tokenizer)
        mean_scorer.pooling = "mean"
        expected_mean = reference_scores(base_dir, random_head(1, "mean"), tmp_path / "features")
        assert mean_scorer.score(prompts[0], [paths[0]])[0] == pytest.approx(expected_mean[0], abs=TOLERANCE)


@pytest.mark.runtime
def test_sglang_ranks_keep_each_tokens_probe_margin_by_kv_slot(tiny_runtime, tiny_probe_head, base_dir, tokenizer):
    """The margins a rank returns equal transformers' for the same ids, for tokens computed in the request, cached
    from an earlier prefill, and cached from an earlier decode, and the scorer reads them into the reference."""
    from policies.probe_readout import META_KEY
    from sgl_tts.frontend.backend import chat_prompt
    from sgl_tts.runtime.server import http_json

    head = ProbeHead.load(tiny_probe_head)
    scorer = ProbeScorer(ScorerConfig(kind="probe", probe_head=str(tiny_probe_head)), tiny_runtime, tokenizer)
    prompts = [chat_prompt(tokenizer, s.problem) for s in SOLUTIONS]
    paths = [s.search_steps() for s in SOLUTIONS]
    for prompt, steps in zip(prompts, paths):  # as the generator would have written them: whole paths in its cache
        http_json(tiny_runtime.url + "/generate", {"text": prompt + "".join(steps),
                                                   "sampling_params": {"max_new_tokens": 1}})
    for prompt, steps in zip(prompts, paths):
        scored = scorer.score_counted(prompt, [steps])
        assert scored.scores[0] == pytest.approx(generator_reference(base_dir, head, tokenizer, prompt, steps),
                                                 abs=POOL_TOLERANCE)
        assert scored.counts.cached_tokens >= scored.counts.input_tokens - 1, "the path was read from the cache"
    prompt_ids = tokenizer(prompts[0] + " Then", add_special_tokens=False).input_ids
    decoded = http_json(tiny_runtime.url + "/generate", {"input_ids": prompt_ids, "sampling_params": {
        "max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}})
    ids = prompt_ids + decoded["output_ids"]
    again = http_json(tiny_runtime.url + "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})
    assert again["meta_info"]["cached_tokens"] >= len(ids) - 2, "the decoded tokens' slots were cached"
    assert again["meta_info"][META_KEY][0] == pytest.approx(token_margins(base_dir, head, ids), abs=POOL_TOLERANCE)
