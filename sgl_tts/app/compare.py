"""`sgl-tts run --compare`: what the configured search buys, side by side in one run.

Two references, then two arms (three when asked), on the same problems:
0. greedy: one answer at temperature 0 (the reference every arm is compared to), and one sample at the
   search's temperature (for best-of-N, `WHOLE_SAMPLE_PROGRAMS`, one of each search's samples: no new draw; drawn
   anew where a stopping rule or a budget may end the search early, as the samples it kept are then the ones that
   ended first, the short ones, and not a uniform draw).
   `sgl-tts run` solves greedy (and a sample drawn anew) beside the search's last problems (`GreedyReference`):
   their requests fill the batch slots the search leaves as its last problems end, where on their own they would be
   a batch of short answers waiting on its longest (about 45 s of `make run` on 2 cores);
1. the configured search (the CPU default: best-of-N with its verifier, FastTTS switches as configured);
2. self-consistency (majority vote, no verifier) at matched generated tokens. When arm 1's candidates are
   independent whole solutions (best-of-N, `WHOLE_SAMPLE_PROGRAMS`) it is the majority of those very samples:
   the same tokens, and the verifier's choice paired sample for sample with the plain vote. Otherwise, on the
   same runtimes, it draws about as many whole solutions per problem as arm 1's tokens pay for
   (`samples_to_match`), and its vote counts the first samples, in launch order, whose tokens add up to no
   more than arm 1 spent on that problem (`matched_vote`);
3. with `fasttts_off`: the configured search with the FastTTS switches (P, M, S) turned off, on runtimes
   restarted for it.
Each arm runs once: the goodput ratio of 3 against 1 is one run's, not a claim (`sgl-tts bench fasttts`
repeats and interleaves arms to claim one). Accuracy comes with its 95% Wilson interval, and every arm is
compared with greedy on the same problems by McNemar's exact test (paired: only the problems one of the two
solves and the other does not count).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import statistics
import threading
from typing import Any, Iterable, Iterator, Sequence

from sgl_tts.measure.stats import mcnemar_exact, wilson_interval
from sgl_tts.measure.metrics import mean_goodput
from sgl_tts.measure.tables import Column, console_table, number_cell
from sgl_tts.search.grading import grade
from sgl_tts.search.records import SearchResult
from sgl_tts.search.selection import majority_vote

SC_MAX_SAMPLES = 16  # self-consistency's largest draw per problem
# Programs whose candidates are independent whole solutions drawn from the one prompt: a majority vote over them
# is self-consistency at exactly the search's tokens, paired sample for sample with its verifier's choice.
WHOLE_SAMPLE_PROGRAMS = ("best_of_n", "self_consistency")


def one_sample(result: SearchResult) -> SearchResult:
    """`result` cut to one of its candidates, its tokens and its time: one sample at the search's temperature. The
    candidates are sorted best-scored first, so the first is the verifier's pick, not a sample; the one taken is
    drawn uniformly, by a hash of the problem id (the same problem takes the same position in every run)."""
    if not result.candidates:
        return dataclasses.replace(result, answer=None, generated_tokens=0)
    digest = hashlib.sha256(str(result.problem_id).encode()).digest()
    sample = result.candidates[int.from_bytes(digest[:4], "big") % len(result.candidates)]
    return dataclasses.replace(result, candidates=[sample], answer=sample.answer, generated_tokens=sample.tokens,
                               total_time_s=sample.completion_time_s)


def majority_of_samples(result: SearchResult) -> SearchResult:
    """`result` answered by the plain majority of its candidates' answers (no verifier)."""
    return dataclasses.replace(result, answer=majority_vote([c.answer for c in result.candidates]))


def samples_to_match(result: SearchResult, max_tokens: int) -> int:
    """How many whole solutions self-consistency draws to spend `result`'s generated tokens: that count over
    the mean length of the search's finished paths (a whole solution's length), plus one to spare; 2 to
    SC_MAX_SAMPLES."""
    lengths = [c.tokens for c in result.candidates if c.finish_reason != "pruned" and c.tokens > 0]
    per_solution = statistics.fmean(lengths) if lengths else max_tokens
    return min(SC_MAX_SAMPLES, max(2, math.ceil(result.generated_tokens / per_solution) + 1))


def matched_vote(result: SearchResult, budget: int) -> SearchResult:
    """`result` (self-consistency) cut to its first candidates whose tokens sum to at most `budget` (at
    least one), with the majority answer of those and their token count as its generated tokens."""
    kept, spent = [], 0
    for candidate in result.candidates:
        if kept and spent + candidate.tokens > budget:
            break
        kept.append(candidate)
        spent += candidate.tokens
    answer = majority_vote([c.answer for c in kept])
    return dataclasses.replace(result, candidates=kept, answer=answer, generated_tokens=spent,
                               extra={**result.extra, "samples_drawn": len(result.candidates)})


@dataclasses.dataclass(frozen=True)
class ArmSummary:
    label: str
    correct: tuple[bool, ...]  # per problem, in the problems' order
    tokens_per_problem: float
    goodput: float | None  # mean precise goodput, tok/s (None: no result has one)
    p50_latency_s: float
    samples: str = ""  # self-consistency: samples counted of drawn
    generated_tokens: int = 0

    @classmethod
    def of(cls, label: str, pairs: Sequence[tuple[Any, SearchResult]], samples: str = "") -> "ArmSummary":
        results = [r for _, r in pairs]
        return cls(label, tuple(p.gold is not None and grade(r.answer, p.gold) for p, r in pairs),
                   statistics.fmean(r.generated_tokens for r in results),
                   mean_goodput(results),
                   statistics.median(r.total_time_s for r in results), samples,
                   sum(r.generated_tokens for r in results))

    @property
    def solved(self) -> int:
        return sum(self.correct)

    @property
    def problems(self) -> int:
        return len(self.correct)

    @property
    def tokens_per_solved(self) -> float | None:
        return self.generated_tokens / self.solved if self.solved else None


def format_comparison(arms: Sequence[ArmSummary], reference: ArmSummary | None = None) -> str:
    """One line per arm: solved with its 95% Wilson interval, tokens per problem and per solved problem,
    goodput, p50 latency, and (with a `reference` arm, greedy) McNemar's exact p against it."""
    columns = [Column("arm", align="<"), Column("solved", 7), Column("95% interval", 13), Column("tokens/problem", 15),
               Column("tokens/solved", 14), Column("goodput tok/s", 14), Column("p50 latency s", 14)]
    columns += [Column("p vs greedy", 12)] if reference else []
    rows = []
    for arm in arms:
        low, high = wilson_interval(arm.solved, arm.problems)
        row = [arm.label + (f" ({arm.samples})" if arm.samples else ""), f"{arm.solved}/{arm.problems}",
               f"{low:.2f}-{high:.2f}", f"{arm.tokens_per_problem:.0f}",
               f"{arm.tokens_per_solved:.0f}" if arm.tokens_per_solved is not None else "-",
               number_cell(arm.goodput), f"{arm.p50_latency_s:.1f}"]
        if reference is not None:
            row.append("-" if arm is reference else f"{mcnemar_exact(reference.correct, arm.correct).p_value:.3f}")
        rows.append(row)
    return console_table(columns, rows, rule=True)


def keeps_every_sample(search: Any) -> bool:
    """Whether each search's result holds all its n independent samples (a whole-sample program that no stopping
    rule or budget ends early and whose samples the verifier does not cut, `stopping.prune`), so that one of them,
    drawn uniformly, is one sample at the search's temperature."""
    return search.program in WHOLE_SAMPLE_PROGRAMS and not search.may_stop_early and not search.cuts_samples


def one_sample_search(search: Any) -> Any:
    """The search config of one sample at the search's temperature (self-consistency of n = 1)."""
    return dataclasses.replace(search, program="self_consistency", n=1)


class GreedyReference:
    """The reference arms, solved on threads of their own beside the search: greedy, and one sample at the search's
    temperature where it is drawn anew (`keeps_every_sample`), every problem at once. `follow` passes the search's
    results through and starts them once `start_after` of them have passed (the search's last problems are then all
    in flight); `results` waits for an arm, starting them first if nothing did."""

    def __init__(self, session: Any, problems: Sequence[Any]):
        self.session, self.problems = session, list(problems)
        search = session.config.search
        self.searches = {"greedy": dataclasses.replace(one_sample_search(search), temperature=0.0)}
        if not keeps_every_sample(search):
            self.searches["one sample"] = one_sample_search(search)
        self.started_after: int | None = None  # search results passed when they started
        self._pairs: dict[str, list[tuple[Any, SearchResult]]] = {name: [] for name in self.searches}
        self._errors: list[BaseException] = []
        self._threads: list[threading.Thread] = []

    def start(self, passed: int | None = None) -> None:
        """Start solving, `passed` search results into the search (None: after it)."""
        if self._threads:
            return
        self.started_after = passed
        for name, search in self.searches.items():
            def solve(name: str = name, search: Any = search) -> None:
                try:  # every problem at once: one answer per problem is a small batch
                    self._pairs[name].extend(self.session.solve_all(self.problems, search=lambda p: search,
                                                                    concurrency=len(self.problems)))
                except BaseException as exc:  # handed to the thread that asks for the results
                    self._errors.append(exc)

            self._threads.append(threading.Thread(target=solve, name=f"reference-{name}", daemon=True))
            self._threads[-1].start()

    def follow(self, pairs: Iterable[tuple[Any, SearchResult]], start_after: int) -> Iterator[tuple[Any, Any]]:
        passed = 0
        if start_after <= 0:  # every problem of the search is in flight from its start
            self.start(0)
        for pair in pairs:
            passed += 1
            if passed >= start_after:
                self.start(passed)
            yield pair

    def results(self, arm: str = "greedy") -> list[tuple[Any, SearchResult]]:
        self.start()
        for thread in self._threads:
            thread.join()
        if self._errors:
            raise self._errors[0]
        return self._pairs[arm]


def run_comparison(session: Any, problems: Sequence[Any], searched: Sequence[tuple[Any, SearchResult]],
                   log=print, fasttts_off: bool = False, greedy: GreedyReference | None = None) -> list[ArmSummary]:
    """The references and arm 2 (and arm 3 with `fasttts_off`) around `searched`, arm 1's (problem, result) pairs
    from `session`; returns them all, greedy first. `greedy`: the greedy arm already under way beside the search
    (default: solved now). `session` is closed on return (arm 3 restarts its runtimes)."""
    from sgl_tts.app.session import Session

    config = session.config
    search_label = f"{config.search.program} n={config.search.n}, {config.scorer.kind} verifier"
    one = one_sample_search(config.search)
    whole_samples = config.search.program in WHOLE_SAMPLE_PROGRAMS
    every_sample = keeps_every_sample(config.search)
    greedy = greedy or GreedyReference(session, problems)
    beside = (f", solved beside the search's last {len(searched) - greedy.started_after} problems (its latency "
              "under their load)" if greedy.started_after is not None else "")
    log("\ngreedy (one answer at temperature 0), the reference" + beside + (
        f"; one sample at temperature {one.temperature:g}: one of each search's samples, drawn uniformly"
        if every_sample else
        ", and one sample at the search's temperature, drawn anew"))
    arms = [ArmSummary.of("greedy, one answer", greedy.results()),
            ArmSummary.of(f"one sample, temperature {one.temperature:g}",
                          [(problem, one_sample(result)) for problem, result in searched] if every_sample else
                          greedy.results("one sample"))]
    arms.append(ArmSummary.of(f"{search_label}, FastTTS {config.fasttts.label}", searched))

    if whole_samples:
        log("\nself-consistency: the majority of the search's own samples (the same tokens, "
            + ("those the verifier's cut of first steps kept, unweighted)" if config.search.cuts_samples
               else "no verifier)"))
        consistency = [(problem, majority_of_samples(result)) for problem, result in searched]
        counted = sum(len(r.candidates) for _, r in consistency)
        arms.append(ArmSummary.of("self-consistency, the same samples", consistency, f"{counted} samples"))
    else:
        arms.append(drawn_consistency(session, problems, searched, log))

    off = dataclasses.replace(config, fasttts=dataclasses.replace(
        config.fasttts, prefix_order=False, memory_plan=False, speculative=False))
    if fasttts_off and off.fasttts != config.fasttts:
        log(f"\n{search_label}, FastTTS off: restarting the runtimes without P, M, S")
        with Session(off, reuse=session.detach()) as session_off:
            arms.append(ArmSummary.of(f"{search_label}, FastTTS off", list(session_off.solve_all(problems))))
    else:
        session.close()
        if fasttts_off:
            log("\nFastTTS is off in this config: no on/off comparison")
    return arms


def drawn_consistency(session: Any, problems: Sequence[Any], searched: Sequence[tuple[Any, SearchResult]],
                      log=print) -> ArmSummary:
    """Self-consistency drawn anew per problem, as many samples as the search's tokens pay for; the vote counts
    those that fit (`samples_to_match`, `matched_vote`)."""
    spent = {str(p.id): r for p, r in searched}
    sc_search = dataclasses.replace(session.config.search, program="self_consistency")
    log("\nself-consistency: per problem, enough samples to spend the search's tokens; the vote counts those "
        "that fit")
    consistency = []
    for problem, result in session.solve_all(problems, search=lambda p: dataclasses.replace(
            sc_search, n=samples_to_match(spent[str(p.id)], sc_search.max_tokens))):
        consistency.append((problem, matched_vote(result, spent[str(problem.id)].generated_tokens)))
    counted = sum(len(r.candidates) for _, r in consistency)
    drawn = sum(r.extra["samples_drawn"] for _, r in consistency)
    return ArmSummary.of("self-consistency, matched tokens", consistency, f"{counted}/{drawn} samples")


def print_comparison(arms: Sequence[ArmSummary]) -> None:
    print("\nside by side (one run per arm; p: McNemar's exact test against greedy on the same problems)")
    print(format_comparison(arms, reference=arms[0]))
    search, off = arms[2], arms[4] if len(arms) == 5 else None
    if off is not None and search.goodput is not None and off.goodput:
        print(f"FastTTS on/off goodput ratio: {search.goodput / off.goodput:.2f}x "
              f"(one run each; `sgl-tts bench fasttts` repeats the arms and claims only separated ranges)")
    elif off is None:
        print("FastTTS on/off: not compared in this run (`--compare-fasttts` adds the search on runtimes restarted "
              "without P, M, S; `sgl-tts bench fasttts` measures FastTTS by its own protocol, one search at a time)")
