"""A scripted, deterministic stand-in for a model and a PRM, for fast tests of search semantics.

`ScriptedModel` decides every step from the text so far and a per-text variant counter (the k-th request
with the same text gets variant k), so forks of one parent get distinct children while a whole search
stays reproducible. `ScriptedBackend` serves it through SGLang's frontend backend interface and
`ScriptedScorer` scores steps from a hash of the path. Brute-force references in the tests enumerate the
same tree without SGLang.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from sglang.lang.backend.base_backend import BaseBackend

from sgl_tts.frontend.backend import SearchBackend
from sgl_tts.frontend.sglang_internals import search_of
from sgl_tts.runtime import zygote
from sgl_tts.scoring.base import ScoreCounts, StepScorer

EOS_ID = 2


def _hash(*parts: object) -> int:
    return int(hashlib.sha256("\x1f".join(map(str, parts)).encode()).hexdigest()[:12], 16)


@dataclass(frozen=True)
class ScriptedModel:
    """Steps are a few words; from `answer_depth` on, a step may give a final answer, or end the text."""

    answer_depth: int = 2
    answer_chance: float = 0.5
    eos_chance: float = 0.1
    answers: int = 4  # answers are drawn from 0..answers-1
    delimiter: str = "\n\n"

    def step(self, text: str, variant: int) -> tuple[str, str]:
        """(step text without delimiter, how it ends: 'step', 'answer' or 'eos') for a path's next step."""
        depth = text.count(self.delimiter)
        h = _hash(text, variant)
        words = [f"w{(h >> (4 * i)) % 97}" for i in range(2 + h % 4)]
        roll = (h % 1000) / 1000
        if depth >= self.answer_depth and roll < self.answer_chance:
            return " ".join(words) + f" The answer is \\boxed{{{(h >> 20) % self.answers}}}.", "answer"
        if depth >= self.answer_depth and roll < self.answer_chance + self.eos_chance:
            return " ".join(words), "eos"
        return " ".join(words), "step"

    def answer_so_far(self, text: str) -> str:
        """What a probe of a path (its text, then an answer cue) writes before its closing brace."""
        return str(_hash("probe", text) % self.answers)

    def top_logprobs(self, word: str, k: int) -> list[tuple[float, int, None]]:
        """The k most likely (logprob, token id, text) at an output word, most likely first: log-probabilities
        −0.05 − spread·j with a per-word spread in [2.5, 6.25], so a word's confidence is 0.05 + spread·(k−1)/2
        and traces of sure words are more confident than others."""
        h = _hash("logprobs", word)
        spread = 2.5 + 0.25 * (h % 16)
        return [(-0.05 - spread * j, (h + j) % 32_000, None) for j in range(k)]


class ScriptedBackend(SearchBackend, BaseBackend):
    """Serves `ScriptedModel` through the frontend: one `generate` per `sgl.gen`, with the lineage tags and
    the reporting to the request's search of every sgl-tts backend. A search seed other than 0 gives other
    (equally reproducible) samples: the variant key becomes (seed, k)."""

    def __init__(self, model: ScriptedModel | None = None):
        super().__init__()
        self.model = model or ScriptedModel()
        self._lock = threading.Lock()
        self._variants: dict[str, int] = defaultdict(int)
        self._seen_prefixes: set[str] = set()
        self.requests: list[dict] = []

    def get_model_name(self) -> str:
        return "scripted"

    def commit_lazy_operations(self, s) -> None:
        # a fork's prefix pre-send: the parent gets its lineage node, as on a runtime
        self.sent(s, lambda: self.request_fields(s))
        with self._lock:
            self._seen_prefixes.add(s.text_)

    def next_variant(self, text: str, seed: int | None) -> int | str:
        with self._lock:
            variant = self._variants[text]
            self._variants[text] += 1
        return variant if not seed else f"{seed}:{variant}"

    def generate(self, s, sampling_params):
        return self.generate_sent(s, sampling_params, self._generate)

    def _generate(self, s, sampling_params):
        began = time.perf_counter()
        text = s.text_
        fields = self.request_fields(s)
        search = search_of(s)
        variant = self.next_variant(text, search.seed if search is not None else None)
        budget = sampling_params.max_new_tokens or 10**9
        stop = sampling_params.stop
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        stops_at_step = self.model.delimiter in stops
        pieces, produced, reason = [], 0, None
        words_out: list[str] = []  # one token per word
        current, current_variant = text, variant
        if "}$" in stops and not stops_at_step:  # a probe for the answer so far (sgl_tts.search.api.probe_answers)
            pieces, produced, reason = [self.model.answer_so_far(text)], 1, {"type": "stop", "matched": "}$"}
            words_out = pieces[:]
        while reason is None:
            step, ending = self.model.step(current, current_variant)
            words = step.split(" ")
            if produced + len(words) > budget:
                words_out += words[: budget - produced]
                pieces.append(" ".join(words[: budget - produced]))
                produced = budget
                reason = {"type": "length", "length": budget}
                break
            produced += len(words)
            words_out += words
            pieces.append(step)
            if ending == "eos":
                reason = {"type": "stop", "matched": EOS_ID}
            elif stops_at_step:
                reason = {"type": "stop", "matched": self.model.delimiter}
            elif ending == "answer":
                reason = {"type": "stop", "matched": EOS_ID}
            else:
                pieces[-1] += self.model.delimiter
                current, current_variant = current + pieces[-1], 0
        output = "".join(pieces)
        with self._lock:
            cached = max((len(p) for p in self._seen_prefixes if text.startswith(p)), default=0)
            self._seen_prefixes.add(text)
            self.requests.append({"text": text, "variant": variant, "fields": fields})
        meta = {"completion_tokens": produced, "prompt_tokens": len(text), "cached_tokens": cached,
                "finish_reason": reason}
        if sampling_params.return_logprob and sampling_params.top_logprobs_num:
            top = [self.model.top_logprobs(word, sampling_params.top_logprobs_num) for word in words_out]
            meta["output_top_logprobs"] = top
            meta["output_token_logprobs"] = [position[0] for position in top]
        self.answered(s, text, began, meta, output)
        return output, meta


class ScriptedScorer(StepScorer):
    """Step score in [0, 1) from a hash of the path up to and including the step.

    `calls` holds the paths of every `score` call (what the search asked); `scored` the (path, first new
    step) pairs the incremental layer passed on to be scored, and it counts one input token per character of
    the path, the characters of the known steps as cached."""

    name = "scripted"

    def __init__(self, salt: str = "prm"):
        super().__init__()
        self.salt = salt
        self.calls: list[list[list[str]]] = []
        self.scored: list[tuple[tuple[str, ...], int]] = []

    def step_score(self, prompt: str, steps: Sequence[str]) -> float:
        return (_hash(self.salt, prompt, *steps) % 10_000) / 10_000

    def score_into(self, prompt: str, paths: Sequence[Sequence[str]], counts: ScoreCounts) -> list[list[float]]:
        with self._lock:
            self.calls.append([list(p) for p in paths])
        return super().score_into(prompt, paths, counts)

    def score_new_steps(self, prompt: str, paths: Sequence[Sequence[str]], first_new: Sequence[int],
                        counts: ScoreCounts) -> list[list[float]]:
        out = []
        for steps, first in zip(paths, first_new):
            with self._lock:
                self.scored.append((tuple(steps), first))
            self._count(sum(len(s) for s in steps), sum(len(s) for s in steps[:first]), counts)
            out.append([self.step_score(prompt, steps[: i + 1]) for i in range(first, len(steps))])
        return out


def wait_until(predicate, timeout: float = 30.0) -> None:
    """Wait for a state, not a fixed time (the bound only makes a broken mechanism fail its test)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "state not reached in time"
        time.sleep(0.05)


def _is_zygote(proc_entry: Path) -> bool:
    """Whether /proc/<pid> is a runtime zygote (sgl_tts/runtime/zygote.py): its owner's to keep until it exits,
    not a runtime left behind (the runtimes it forks show their own command line)."""
    return zygote.MODULE.encode() in (proc_entry / "cmdline").read_bytes().split(b"\0")


def processes_with_env(name: str, value: str) -> list[int]:
    """Pids of live processes whose environment holds `name=value`: a test exports a unique tag before it
    starts runtimes (children inherit it, and so does a zygote started meanwhile, whose forks show its
    environment) and then checks that none is left running."""
    needle = f"{name}={value}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0") and not _is_zygote(entry):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids
