"""The likelihood scorer: a step's score is the scorer model's geometric-mean token probability of it."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from sgl_tts.scoring.base import ScoreCounts, ScorerError, StepScorer


class LikelihoodScorer(StepScorer):
    """Score of a step = exp(mean token log-likelihood of the step under the scorer model).

    The geometric-mean token probability of the step given the prompt and the steps before it. On the CPU
    default it separates right from wrong steps where yes/no prompting does not (docs/sglang.md).
    """

    name = "likelihood"

    def __init__(self, runtime, tokenizer, max_parallel: int = 64):
        super().__init__()
        self.runtime = runtime  # sgl_tts.runtime.server.Runtime (needs .url, .name, .check_alive())
        self.tokenizer = tokenizer
        self.max_parallel = max_parallel

    def _tokenize(self, prompt: str, steps: Sequence[str]) -> tuple[list[int], list[int]]:
        """Token ids of prompt+steps and, per step, the index of its first token. Each part is tokenized on
        its own, so a step's tokens do not depend on the steps after it."""
        ids = list(self.tokenizer(prompt, add_special_tokens=False).input_ids)
        starts = []
        for step in steps:
            starts.append(len(ids))
            ids += self.tokenizer(step, add_special_tokens=False).input_ids
        return ids, starts

    def _score_path(self, prompt: str, steps: Sequence[str], first_new: int, counts: ScoreCounts) -> list[float]:
        from sgl_tts.runtime.server import http_json, request_timeout

        ids, starts = self._tokenize(prompt, steps)
        # Logprobs from one token before the first new step: SGLang serves cached prefix tokens only up to
        # logprob_start_len, so the prompt and the known steps can come from the radix cache.
        offset = max(0, starts[first_new] - 1)
        payload = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": offset,
        }
        try:
            answer = http_json(self.runtime.url + "/generate", payload, timeout=request_timeout(self.runtime))
        except OSError as exc:
            self.runtime.check_alive()
            raise ScorerError(f"scorer runtime '{self.runtime.name}' at {self.runtime.url} failed: {exc}") from exc
        meta = answer["meta_info"]
        # input_token_logprobs[j] is (logprob, token_id, _) of token offset+j; entry 0 may be None (its
        # predecessor is not recomputed) and belongs to the step before, so every new step token has one.
        logprobs = [entry[0] for entry in meta["input_token_logprobs"]]
        self._count_answer(meta, len(ids), counts)
        scores = []
        bounds = list(starts) + [len(ids)]
        for i in range(first_new, len(steps)):
            values = [logprobs[t - offset] for t in range(bounds[i], bounds[i + 1])
                      if 0 <= t - offset < len(logprobs) and logprobs[t - offset] is not None]
            scores.append(math.exp(sum(values) / len(values)) if values else 0.0)
        return scores

    def score_new_steps(self, prompt: str, paths: Sequence[Sequence[str]], first_new: Sequence[int],
                        counts: ScoreCounts) -> list[list[float]]:
        def one(index: int) -> list[float]:
            return self._score_path(prompt, paths[index], first_new[index], counts)

        if len(paths) <= 1:
            return [one(i) for i in range(len(paths))]
        with ThreadPoolExecutor(max_workers=min(self.max_parallel, len(paths))) as pool:
            return list(pool.map(one, range(len(paths))))
