"""The project's step scorer behind its-hub's reward-model interfaces, and its-hub's OpenAI-compatible client counted.

Needs its-hub (the `peers` extra: `make peers`); `sgl_tts.bench.peers` imports this module only when it runs an
its-hub system.

- `PathScorer` (no its-hub needed): what both reward models do with a text. The prompt is the generator's, as
  sgl-tts's programs hand it to the scorer (`Runtimes.prompt(question)`: the chat template with the system prompt);
  the text is cut into steps at the run config's step delimiter the way best-of-N cuts a whole solution
  (`split_steps`, at most `max_steps`); each path's step scores become one number by the config's aggregation.
  Its scorer is a scorer of its own with incremental scoring off: every call scores every step of every path
  from the first, one PRM request per call, which is what a user's whole-path PRM client does (its runtime's
  radix cache still serves what it holds).
- `ProbeOutcomeRewardModel`: its-hub's `AbstractOutcomeRewardModel` (BestOfN's scorer). BestOfN hands it the
  conversations [user: question, assistant: candidate]; the score is the candidate's aggregated path score.
- `ProbeProcessRewardModel`: its-hub's `AbstractProcessRewardModel` (BeamSearch, ParticleFiltering). Those call
  `ascore(prompt, [partial response, ...])` after every step, each response its steps so far joined by the step
  token; the score of each is its aggregated path score (ParticleFiltering takes it as a probability: scores
  lie in [0, 1]).
  The scorer blocks on HTTP: `ascore` runs it in a worker thread, as its-hub's own local PRM does.
- `CountingLanguageModel`: its-hub's `OpenAICompatibleLanguageModel`, counting and keeping every request body it
  sends (`sgl_tts.bench.peers.RequestLog`). its-hub posts through aiohttp sessions it makes itself, so the count
  is taken where it builds each request's JSON (`_prepare_request_data`, called once per HTTP attempt, retries
  included).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from its_hub.api import AbstractOutcomeRewardModel, AbstractProcessRewardModel, ChatMessage, ChatMessages
from its_hub.core.lms.openai_lm import OpenAICompatibleLanguageModel

from sgl_tts.scoring.base import StepScorer, aggregate
from sgl_tts.search.api import split_steps


@dataclass
class PathScorer:
    """Aggregated path scores of texts answering one question, by `scorer` on the generator's `prompt`."""

    scorer: StepScorer
    prompt: Callable[[str], str]  # question -> the generator's prompt text
    step_delimiter: str
    max_steps: int
    aggregation: str

    def __post_init__(self) -> None:
        self.scorer.set_incremental(False)  # every call from the first step, as a whole-path PRM client scores

    def score(self, question: str, texts: Sequence[str]) -> list[float]:
        paths = [split_steps(text, self.step_delimiter, self.max_steps) for text in texts]
        step_scores = self.scorer.score(self.prompt(question), paths)
        return [aggregate(scores, self.aggregation) for scores in step_scores]


def question_of(messages: Sequence[ChatMessage] | str | ChatMessages) -> str:
    """The last user turn's text of a conversation (its-hub passes a string prompt as one user message)."""
    turns = ChatMessages.from_prompt_or_messages(messages).to_chat_messages()
    users = [turn for turn in turns if turn.role == "user"]
    if not users:
        raise ValueError(f"a conversation to score needs a user turn (the question); got roles "
                         f"{[turn.role for turn in turns]}")
    return users[-1].extract_text_content()


def _message(item: Any) -> ChatMessage:
    return item if isinstance(item, ChatMessage) else ChatMessage.from_dict(item)


class ProbeOutcomeRewardModel(AbstractOutcomeRewardModel):
    """Whole-answer scores for its-hub's BestOfN: each conversation's last (assistant) turn scored as a path,
    one PRM call per question (BestOfN's candidates all answer one)."""

    def __init__(self, paths: PathScorer):
        self.paths = paths

    def score(self, messages: Any, **kwargs: Any) -> list[float] | float:
        single = bool(messages) and not isinstance(messages[0], (list, tuple))
        scores = self.score_conversations([messages] if single else messages)
        return scores[0] if single else scores

    async def ascore(self, messages: Any, orchestrator: Any = None, **kwargs: Any) -> list[float]:
        return await asyncio.to_thread(self.score_conversations, messages)

    def score_conversations(self, conversations: Sequence[Sequence[Any]]) -> list[float]:
        by_question: dict[str, list[int]] = {}
        answers = []
        for index, conversation in enumerate(conversations):
            turns = [_message(turn) for turn in conversation]
            if not turns or turns[-1].role != "assistant":
                raise ValueError(f"conversation {index}: an outcome to score ends with the assistant's answer; got "
                                 f"roles {[turn.role for turn in turns]}")
            by_question.setdefault(question_of(turns[:-1]), []).append(index)
            answers.append(turns[-1].extract_text_content())
        scores = [0.0] * len(answers)
        for question, indices in by_question.items():
            for index, score in zip(indices, self.paths.score(question, [answers[i] for i in indices])):
                scores[index] = score
        return scores


class ProbeProcessRewardModel(AbstractProcessRewardModel):
    """Partial-response scores for its-hub's BeamSearch and ParticleFiltering."""

    def __init__(self, paths: PathScorer):
        self.paths = paths

    def score(self, prompt_or_messages: Any, steps: Sequence[str] | str) -> list[float] | float:
        single = isinstance(steps, str)
        scores = self.paths.score(question_of(prompt_or_messages), [steps] if single else list(steps))
        return scores[0] if single else scores

    async def ascore(self, prompt_or_messages: Any, steps: Sequence[str] | str) -> list[float] | float:
        return await asyncio.to_thread(self.score, prompt_or_messages, steps)


class CountingLanguageModel(OpenAICompatibleLanguageModel):
    """its-hub's OpenAI-compatible client, every request body it builds logged in `log` (one per HTTP attempt)."""

    def __init__(self, *args: Any, log: Any, **kwargs: Any):  # log: sgl_tts.bench.peers.RequestLog
        super().__init__(*args, **kwargs)
        self.log = log

    def _prepare_request_data(self, *args: Any, **kwargs: Any) -> dict:
        data = super()._prepare_request_data(*args, **kwargs)
        self.log.add(data)
        return data
