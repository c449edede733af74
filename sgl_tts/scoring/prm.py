"""Process reward models behind the `StepScorer` interface, each served by an SGLang runtime.

- `MathShepherdScorer` (kind `math_shepherd`): the PRM reads `question step1<tag>\\nstep2<tag>...`; the
  score of step k is P(+) / (P(+) + P(-)) of the next token at the end of its tag (Wang et al., Math-Shepherd).
- `RLHFlowScorer` (kind `rlhflow`): a chat where the user turns are the question with step 1, then each
  further step, and every assistant turn is `+`; the score of step k is P(+) / (P(+) + P(-)) where the
  assistant's k-th `+` is predicted (RLHFlow's Llama-3.1-8B-PRM recipe).
- `ClassifierPRMScorer` (kind `classifier`): a step-classifier PRM (Qwen2.5-Math-PRM style) served by
  `sgl_tts.scoring.prm_models`; the score is the classifier's P(correct) at the step token after each step.
- `SkyworkPRMScorer` (kind `skywork`): Skywork-o1-Open-PRM, a value head served by the same package; the
  score is sigmoid(value) at the newline that ends each step.

The two logprob-tag PRMs run on a plain SGLang runtime: one batched `/generate` with `max_new_tokens=1`,
`return_logprob` and `token_ids_logprob=[+, -]`. Tags, tokens and ids come from `ScorerConfig`. All of them
read the question, found in the generator's prompt by `ScorerConfig.question_pattern`.
"""

from __future__ import annotations

import math
import re
from typing import Any, Sequence

from sgl_tts.runtime.server import request_timeout, RuntimeConfig
from sgl_tts.scoring.base import ScoreCounts, ScorerError, StepScorer
from sgl_tts.scoring.runtime_calls import post_to_runtime, runtime_failures
from sgl_tts.scoring.scorer_config import ScorerConfig


def classifier_runtime_config(model: str, cached: bool = False, **overrides: Any) -> RuntimeConfig:
    """The runtime a step-classifier PRM needs (our model class, its memory knobs): embedding mode without
    a radix cache, or with `cached` generation mode, where the folded head is read through logprobs and the
    radix cache serves the known steps (sgl_tts.scoring.prm_models.qwen2_prm)."""
    from sgl_tts.scoring.prm_models import EXTERNAL_MODEL_ENV, SERVER_ARGS

    # Without chunked prefill SGLang's default static fraction reserves max_prefill_tokens * 1.5 MB of activations
    # and goes negative on a small host, so both memory knobs are set.
    # The pool in the weights' dtype (fp32 on a CPU, not the bf16 a generator gets there): a PRM only prefills, and
    # its step scores stay its reference's.
    settings: dict[str, Any] = dict(model=model, env=dict(EXTERNAL_MODEL_ENV), mem_fraction_static=0.3,
                                    max_total_tokens=16384, kv_cache_dtype="model")
    if not cached:
        settings.update(is_embedding=True, extra_args=list(SERVER_ARGS))
    settings.update(overrides)
    return RuntimeConfig(**settings)


class _RuntimePRM(StepScorer):
    """Shared by the PRM scorers: the runtime, the tokenizer, the question and runtime failures."""

    def __init__(self, config: ScorerConfig, runtime: Any, tokenizer: Any):
        super().__init__()
        self.config = config
        self.runtime = runtime  # sgl_tts.runtime.server.Runtime (needs .url, .name, .check_alive())
        self.tokenizer = tokenizer
        self._question = re.compile(config.question_pattern, re.S)

    def question_of(self, prompt: str) -> str:
        matches = self._question.findall(prompt)
        if not matches:
            raise ValueError(f"scorer '{self.name}': the generator prompt does not match scorer.question_pattern "
                             f"{self.config.question_pattern!r}; set it to capture the question. "
                             f"Prompt: {prompt[:200]!r}")
        last = matches[-1]
        return (last[0] if isinstance(last, tuple) else last).strip()

    def post(self, route: str, payload: dict[str, Any]) -> Any:
        return post_to_runtime(self.runtime, route, payload)


class LogprobTagScorer(_RuntimePRM):
    """A PRM read through next-token logprobs of its positive and negative tokens at one place per step."""

    def __init__(self, config: ScorerConfig, runtime: Any, tokenizer: Any):
        super().__init__(config, runtime, tokenizer)
        self.positive_id = self._token_id(config.positive_token, config.positive_token_id, "positive_token")
        self.negative_id = self._token_id(config.negative_token, config.negative_token_id, "negative_token")
        if self.positive_id == self.negative_id:
            raise ValueError(f"positive and negative tokens are both token id {self.positive_id}")

    def _token_id(self, text: str, explicit: int | None, field: str) -> int:
        if explicit is not None:
            return explicit
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        if len(ids) != 1:
            raise ValueError(f"scorer.{field} {text!r} is {len(ids)} tokens {ids} for this tokenizer; "
                             f"set scorer.{field}_id to the token id the PRM was trained to predict")
        return ids[0]

    def layout(self, question: str, steps: Sequence[str]) -> tuple[str, list[int], bool]:
        """(PRM input text, one character offset per step, add the tokenizer's special tokens).

        The offset is where the PRM's verdict for the step would be written: the score is read from the
        next-token distribution of the token that ends exactly there. A PRM lays out text here, or ids in
        `encode`."""
        raise NotImplementedError(f"scorer '{self.name}' implements neither layout nor encode")

    def encode(self, question: str, steps: Sequence[str]) -> tuple[list[int], list[int]]:
        """(PRM input ids, per step the index of the token whose next-token distribution is its verdict)."""
        return self.readout_positions(*self.layout(question, steps))

    def readout_positions(self, text: str, offsets: Sequence[int], special: bool) -> tuple[list[int], list[int]]:
        """Token ids of `text` and, per offset, the index of the (last) token ending exactly at that offset."""
        encoded = self.tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
        ids = list(encoded.input_ids)
        ending_at = {end: index for index, (start, end) in enumerate(encoded.offset_mapping) if end > start}
        positions = []
        for offset in offsets:
            if offset not in ending_at:
                raise ValueError(f"scorer '{self.name}': no token boundary at character {offset} of the PRM input "
                                 f"({text[max(0, offset - 20):offset + 20]!r}); choose a step tag that the "
                                 "tokenizer keeps apart from the text around it")
            positions.append(ending_at[offset])
        return ids, positions

    def score_new_steps(self, prompt: str, paths: Sequence[Sequence[str]], first_new: Sequence[int],
                        counts: ScoreCounts) -> list[list[float]]:
        question = self.question_of(prompt)
        requests = [self.encode(question, steps) for steps in paths]
        self._prefill_shared_prefix([ids for ids, _ in requests], first_new,
                                    lambda payload: self.post("/generate", payload), counts)
        # Logprob entry j of the input is the distribution at position start + j - 1 (the one predicting
        # token start + j); the last position's distribution is the first output token's. Starting at the
        # first new step's readout lets the runtime serve everything before it from its radix cache (it
        # serves cached tokens only up to logprob_start_len).
        starts = [positions[first] for (_, positions), first in zip(requests, first_new)]
        answers = self.post("/generate", {
            "input_ids": [ids for ids, _ in requests],
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": starts,
            "token_ids_logprob": [self.positive_id, self.negative_id],
        })
        answers = answers if isinstance(answers, list) else [answers]
        out = []
        for (ids, positions), first, start, answer in zip(requests, first_new, starts, answers, strict=True):
            meta = answer["meta_info"]
            self._count_answer(meta, len(ids), counts)
            scores = []
            for position in positions[first:]:
                if position + 1 < len(ids):
                    entry = meta["input_token_ids_logprobs"][position + 1 - start]
                else:
                    entry = meta["output_token_ids_logprobs"][0]
                scores.append(self.verdict(entry))
            out.append(scores)
        return out

    def verdict(self, entry: Sequence[Sequence[Any]]) -> float:
        """P(+) / (P(+) + P(-)) = sigmoid(logprob(+) - logprob(-)) from SGLang's [[logprob, id, text], ...]."""
        logprob = {int(item[1]): float(item[0]) for item in entry}
        difference = logprob[self.negative_id] - logprob[self.positive_id]
        return 1.0 / (1.0 + math.exp(difference)) if difference < 700 else 0.0


class MathShepherdScorer(LogprobTagScorer):
    """Math-Shepherd: `{question} {step 1}{tag}\\n{step 2}{tag}...`, read at the end of every tag."""

    name = "math_shepherd"

    def layout(self, question: str, steps: Sequence[str]) -> tuple[str, list[int], bool]:
        text, offsets = f"{question} ", []
        for index, step in enumerate(steps):
            text += ("\n" if index else "") + step.strip() + self.config.step_tag
            offsets.append(len(text))
        return text, offsets, True


class RLHFlowScorer(LogprobTagScorer):
    """RLHFlow: a chat of (user: step, assistant: `+`) turns in the PRM's chat template, read before each `+`."""

    name = "rlhflow"

    def layout(self, question: str, steps: Sequence[str]) -> tuple[str, list[int], bool]:
        verdict = self.config.positive_token
        conversation: list[dict[str, str]] = []
        offsets = []
        for index, step in enumerate(steps):
            turn = f"{question} {step.strip()}" if index == 0 else step.strip()
            conversation.append({"role": "user", "content": turn})
            prefix = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
            offsets.append(len(prefix))
            conversation.append({"role": "assistant", "content": verdict})
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False)
        for offset in offsets:
            if not text.startswith(verdict, offset):
                raise ValueError(f"scorer 'rlhflow': the chat template does not put the assistant turn "
                                 f"{verdict!r} right after the generation prompt")
        return text, offsets, False


class ClassifierPRMScorer(LogprobTagScorer):
    """P(correct) at the step token after every step, from a `Qwen2ForProcessRewardModel` runtime.

    On a generation runtime (`classifier_runtime_config(model, cached=True)`) the model folds its head into
    the LM head, so the scorer reads P(correct) like a logprob-tag PRM, from the first new step's token on,
    and the runtime serves the question and the known steps from its radix cache. On an embedding runtime
    (`--is-embedding`, no radix cache) it reads every step token through `/encode`.
    """

    name = "classifier"

    def __init__(self, config: ScorerConfig, runtime: Any, tokenizer: Any):
        from sgl_tts.scoring.prm_models import CORRECT_TOKEN, INCORRECT_TOKEN

        _RuntimePRM.__init__(self, config, runtime, tokenizer)
        self.step_token_id = tokenizer.convert_tokens_to_ids(config.step_token)
        if self.step_token_id is None or self.step_token_id == tokenizer.unk_token_id:
            raise ValueError(f"scorer.step_token {config.step_token!r} is not a token of the PRM's tokenizer")
        self.positive_id, self.negative_id = CORRECT_TOKEN, INCORRECT_TOKEN
        self.embedding = getattr(getattr(runtime, "config", None), "is_embedding", True)

    def texts(self, question: str, paths: Sequence[Sequence[str]]) -> list[str]:
        from sgl_tts.scoring.prm_models.client import SYSTEM_PROMPT, build_prm_text

        step_token = self.config.step_token
        # A step that spells the step token itself would add a readout: drop it from the step text.
        return [build_prm_text(question, [step.replace(step_token, "") for step in steps],
                               self.config.system_prompt or SYSTEM_PROMPT, step_token) for steps in paths]

    def layout(self, question: str, steps: Sequence[str]) -> tuple[str, list[int], bool]:
        (text,) = self.texts(question, [steps])
        ends = [match.end() for match in re.finditer(re.escape(self.config.step_token), text)]
        return text, ends[len(ends) - len(steps):], False

    def score_new_steps(self, prompt: str, paths: Sequence[Sequence[str]], first_new: Sequence[int],
                        counts: ScoreCounts) -> list[list[float]]:
        if not self.embedding:
            return super().score_new_steps(prompt, paths, first_new, counts)
        from sgl_tts.scoring.prm_models.client import batch_classifier_step_rewards

        texts = self.texts(self.question_of(prompt), paths)
        with runtime_failures(self.runtime):
            rewards = batch_classifier_step_rewards(self.runtime.url, texts, self.step_token_id,
                                                    timeout=request_timeout(self.runtime))
        for steps, text, path_rewards in zip(paths, texts, rewards):
            # The embedding runtime runs without a radix cache (see prm_models): every token is read again.
            self._count(len(self.tokenizer(text, add_special_tokens=False).input_ids), 0, counts)
            if len(path_rewards) != len(steps):
                raise ScorerError(f"scorer runtime '{self.runtime.name}' returned {len(path_rewards)} step rewards "
                                  f"for {len(steps)} steps")
        return [list(r[first:]) for r, first in zip(rewards, first_new)]


class SkyworkPRMScorer(LogprobTagScorer):
    """Skywork-o1-Open-PRM (`Qwen2ForPrmModel`: a value head, sigmoid(value) at the newline ending a line).

    The PRM reads the tokenizer's BOS, the question and a newline, then every line of the solution tokenized
    on its own and followed by the newline token, as it was trained to; a step's score is the reward at its
    last line's newline. The runtime serves the model class in generation mode
    (`classifier_runtime_config(model, cached=True)`), where the value is folded into the LM head and read
    through logprobs like the classifier PRM's, with the radix cache on.
    """

    name = "skywork"

    def __init__(self, config: ScorerConfig, runtime: Any, tokenizer: Any):
        from sgl_tts.scoring.prm_models import CORRECT_TOKEN, INCORRECT_TOKEN

        _RuntimePRM.__init__(self, config, runtime, tokenizer)
        if getattr(getattr(runtime, "config", None), "is_embedding", False):
            raise ValueError("scorer 'skywork' reads the value head through logprobs: serve the PRM in generation "
                             "mode (sgl_tts.scoring.prm.classifier_runtime_config(model, cached=True))")
        self.positive_id, self.negative_id = CORRECT_TOKEN, INCORRECT_TOKEN
        self.newline_id = self._ids("\n")[-1]

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def encode(self, question: str, steps: Sequence[str]) -> tuple[list[int], list[int]]:
        ids = self._ids((self.tokenizer.bos_token or "") + question + "\n")
        positions = []
        for step in steps:
            for line in step.strip().split("\n"):
                ids += (self._ids(line) if line else []) + [self.newline_id]
            positions.append(len(ids) - 1)
        return ids, positions
