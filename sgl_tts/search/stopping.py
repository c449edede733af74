"""Stopping rules beneath every step program (`search.stopping`), and the small rule classes they are made of.

Three rules, each a small class of numbers and answers (no paths, no requests), used by the search context and
`expand` (sgl_tts/search/context.py, sgl_tts/search/api.py) for any program, and by programs/deepconf.py, and a
cut of samples by their first step's score (`prune`, below):

- `TraceConfidenceRule` (DeepConf, Fu et al. 2025): a path's confidence is its lowest sliding-window group
  confidence (`lowest_group_confidence`); the first `warmup` paths that end set the threshold s, the
  (1 − keep_fraction) quantile of their confidences (`OnlineThreshold.from_warmup`); from then on a live path
  whose confidence falls below s is stopped: it gets no further request and ends "low_confidence". It needs
  the tokens' top logprobs, which `expand` then asks for (`Stopping.logprobs`).
- `SettledAnswerRule` (certaindex / Dynasor-style early exit): once at least `min_answers` paths have ended with
  an answer and the leading answer holds `consensus` of them (`vote_settled`, one vote each) and was given by at
  least `agree` of them, the search stops sending and answers with that answer (`SearchResult.finish_reason`
  "settled"). `agree` asks for agreement itself, whatever the other answers: with staged sending, best-of-N's
  vote settles once `agree` samples gave one answer, though most samples disagree (a weak model's answers do).
- `RankedEndRule` (the classic ending of a beam search, and its-hub's `BeamSearch`): after each scoring round the
  search ranks every path it has scored, ended and live, by its aggregated score (`rank_key`); once the `top` best
  have all ended and a live path is left, the search stops and answers by its selection over the ended paths
  (`finish_reason` "ranked"). A live path ranked below them could still overtake them with later steps; the rule
  bets it will not, and saves those steps.

With `reads: ended` (the default) both rules hear a path only when it ends, and a program that sends its paths at
once (best-of-N's n samples, the children of one expansion) has spent nearly all its tokens by then. With
`reads: live` they read the live paths after every step (`expand`): the confidence threshold is set by every path of
the first step that carries confidences (ended or not), and each live path is asked for its answer so far (Dynasor's
probe: its text, then `answer_cue`, then at most `probe_tokens` greedy tokens up to the closing brace, from the
radix cache but for those tokens), so the vote of the ended answers and the live paths' answers can settle the
search after its first step. With `steady` k > 1 a live path's answer is cast only once its last k probes (its
ancestors' and its own) gave it (Dynasor's certaindex asks for consecutive agreeing probes): an answer guessed
before any work is done, often a number from the question, is not cast. The probes are requests of the search:
their tokens count.

`prune` τ > 0 cuts a sample where its first step ends when the verifier scores that step below τ (the early
rejection of speculative-rejection best-of-N, with the PRM's step score for the partial reward): a request of the
search that writes a whole solution (one with no stop string of its own: best-of-N's and self-consistency's
samples; a step request already ends at the step) is sent in two parts beneath the program, to the first step
delimiter and, when its score is at least τ, the rest (`SearchBackend`, sgl_tts/frontend/backend.py). A cut sample
ends unfinished, as an aborted one does: no answer, not heard by the rules, not voted; the last of a search's n
samples is never cut once the other n - 1 were, so the search has an answer. The verifier is causal, so
the final scoring finds the first step's score in its memo. It needs the search's scorer; without one nothing is
cut.

`enough` τ > 0 stops sending a step's children once the verifier is content (the sufficiency test of adaptive
sampling, per parent): `expand` sends each parent's children in at most `waves` waves (ceil(k / waves) children a
wave), the verifier scores each wave's new steps, and a parent with a child whose new step scores at least τ sends
no more children in this step. The program gets the children that were sent: fewer where the verifier was content
(as under a budget's narrowing), and a parent always gets its first wave. Where a beam search's or DVTS's first
step is most of its tokens (`docs/stopping.md`), no rule that decides between steps can save more than the steps
after it; this one saves inside the step. It needs the search's scorer; without one every child is sent at once.

`programs` limits the rules to the programs named (a config tuned for best-of-N, run with another program, stops
nothing). `stage` staggers any program beneath it: at most `stage` of the search's generator requests are in flight,
the others wait in the order they were sent and go out as earlier ones end (`SearchContext.request_sent`), so the
first paths' answers can settle the vote before the rest are sent. Sequential sampling with a stopping test is what
Adaptive-Consistency and DeepConf's online mode do within one program; here the program is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Sequence

from sgl_tts.config import FieldValueError
from sgl_tts.search.confidence import OnlineThreshold, lowest_group_confidence, vote_settled, weighted_vote

RULES = ("none", "confidence", "settled", "both", "ranked")
READS = ("ended", "live")
LOW_CONFIDENCE = "low_confidence"  # a path's finish reason
SETTLED, RANKED = "settled", "ranked"  # a search's finish reasons (stopped by a rule)


@dataclass(frozen=True)
class Stopping:
    """`search.stopping`: which rules stop paths and the search, and their thresholds."""

    rule: Literal["none", "confidence", "settled", "both", "ranked"] = "none"
    top_k: int = 5  # confidence: logprobs per token in the token confidence
    window: int = 32  # confidence: tokens per group
    keep_fraction: float = 0.9  # confidence: η, the share of warm-up paths above the threshold
    warmup: int = 4  # confidence: ended paths that set the threshold
    consensus: float = 0.6  # settled: the leading answer's share of the answers
    min_answers: int = 2  # settled: answers before the vote may settle
    agree: int = 1  # settled: answers the leading answer must hold before the vote may settle
    top: int = 1  # ranked: the best-ranked paths that must all have ended
    stage: int = 0  # generator requests of the search in flight at once, the rest sent as they end (0: no limit)
    reads: Literal["ended", "live"] = "ended"  # what the rules hear: ended paths, or every live path after each step
    answer_cue: str = "The answer is $\\boxed{"  # live: what a probe appends to a path (the system prompt's ending)
    probe_tokens: int = 8  # live: greedy tokens a probe may write before its closing brace
    steady: int = 1  # live: a path's answer is cast once its last `steady` probes (its ancestors' too) agree
    prune: float = 0.0  # a whole-solution sample whose first step the verifier scores below this is cut (0: none)
    enough: float = 0.0  # a parent sends no more children in a step once one's new step scores this (0: all at once)
    waves: int = 4  # enough: a parent's children in a step are sent in at most this many waves
    programs: tuple[str, ...] = ()  # the programs these rules stop (by `search.program`; empty: every program)

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise FieldValueError("rule", f"stopping.rule must be one of {', '.join(RULES)}, got {self.rule!r}")
        if self.reads not in READS:
            raise FieldValueError("reads", f"stopping.reads must be one of {', '.join(READS)}, got {self.reads!r}")
        if not self.answer_cue.strip():
            raise FieldValueError("answer_cue", "stopping.answer_cue must not be empty")
        for name in ("top_k", "window", "warmup", "min_answers", "agree", "top", "probe_tokens", "steady", "waves"):
            if getattr(self, name) < 1:
                raise FieldValueError(name, f"stopping.{name} must be at least 1, got {getattr(self, name)}")
        if self.stage < 0:
            raise FieldValueError("stage", f"stopping.stage must be 0 (no limit) or more, got {self.stage}")
        if not 0 <= self.prune < 1:
            raise FieldValueError("prune", f"stopping.prune must be in [0, 1) (0: cut nothing), got {self.prune}")
        if not 0 <= self.enough <= 1:
            raise FieldValueError("enough", f"stopping.enough must be in [0, 1] (0: send every child at once), "
                                            f"got {self.enough}")
        for name in ("keep_fraction", "consensus"):
            if not 0 < getattr(self, name) <= 1:
                raise FieldValueError(name, f"stopping.{name} must be in (0, 1], got {getattr(self, name)}")
        if not all(isinstance(name, str) and name.strip() for name in self.programs):
            raise FieldValueError("programs", f"stopping.programs must be program names, got {list(self.programs)!r}")

    def beneath(self, program: str) -> "Stopping":
        """These rules where they stop `program`, else none (`programs` names others)."""
        return self if not self.programs or program in self.programs else Stopping()

    @property
    def confidence(self) -> bool:
        return self.rule in ("confidence", "both")

    @property
    def settled(self) -> bool:
        return self.rule in ("settled", "both")

    @property
    def ranked(self) -> bool:
        return self.rule == "ranked"

    @property
    def probes(self) -> bool:
        """Whether live paths are asked for their answers so far after each step."""
        return self.settled and self.reads == "live"

    @property
    def logprobs(self) -> int:
        """Top logprobs a step request needs for these rules (0: none)."""
        return self.top_k if self.confidence else 0


class TraceConfidenceRule:
    """DeepConf's online stop: the threshold from the first `warmup` confidences heard (`warm_up`), then
    `should_stop(c)` when c < s. Before the threshold is set nothing stops."""

    def __init__(self, window: int, keep_fraction: float, warmup: int):
        self.window = window
        self.keep_fraction = keep_fraction
        self.warmup = warmup
        self.warmup_confidences: list[float] = []
        self.threshold: OnlineThreshold | None = None

    def confidence(self, token_confidences: Sequence[float]) -> float:
        """A path's confidence: min_G C_G over its tokens so far."""
        return lowest_group_confidence(token_confidences, self.window)

    def warm_up(self, confidence: float) -> None:
        """Hear an ended warm-up path's confidence; the `warmup`-th sets the threshold (later ones are ignored)."""
        if self.threshold is None:
            self.warmup_confidences.append(confidence)
            if len(self.warmup_confidences) >= self.warmup:
                self.threshold = OnlineThreshold.from_warmup(self.warmup_confidences, self.keep_fraction)

    def warm_up_at_once(self, confidences: Sequence[float]) -> None:
        """Set the threshold from all of `confidences` (the paths of one step), unless it is set or they are fewer
        than `warmup`."""
        if self.threshold is None and len(confidences) >= self.warmup:
            self.warmup_confidences = list(confidences)
            self.threshold = OnlineThreshold.from_warmup(self.warmup_confidences, self.keep_fraction)

    def should_stop(self, confidence: float) -> bool:
        return self.threshold is not None and self.threshold.should_stop(confidence)


@dataclass(frozen=True)
class SettledAnswerRule:
    """The vote is settled: no path remains, or at least `min_answers` answers are cast and the leader (by weight)
    holds `consensus` of the weight (`vote_settled`) and `agree` of the answers."""

    consensus: float
    min_answers: int = 1
    agree: int = 1

    def settled(self, answers: Sequence[str | None], weights: Sequence[float], remaining: int) -> bool:
        cast = sum(answer is not None for answer in answers)
        if remaining > 0 and cast < self.min_answers:
            return False
        if remaining > 0 and self.agree > 1:
            leader = weighted_vote(answers, weights)
            if sum(answer == leader for answer in answers) < self.agree:
                return False
        return vote_settled(answers, weights, remaining_traces=remaining, consensus=self.consensus)


@dataclass(frozen=True)
class RankedEndRule:
    """The `top` best-ranked paths have all ended, and a live path is left (with none left the search ends by
    itself). `ended` and `live` are the paths' rank keys (smaller ranks better; `rank_key`)."""

    top: int = 1

    def ended(self, ended: Sequence[Any], live: Sequence[Any]) -> bool:
        if not ended or not live:
            return False
        best = sorted([(key, False) for key in ended] + [(key, True) for key in live])[: self.top]
        return not any(is_live for _, is_live in best)
