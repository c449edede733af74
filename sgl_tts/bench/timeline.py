"""`sgl-tts bench timeline`: what recording a search's timeline costs (`record_timeline` on against off).

The same beam searches on the scripted backend (`sgl_tts.testing`: no model, so a search takes milliseconds and
the recording's cost is as large a share of it as it can be), with the timeline off and on, interleaved
repeats; each repeat solves every problem once per arm. Reported: milliseconds per search and the windows
recorded per search, median [min-max], and the difference per recorded window. The scripted search runs on
SGLang's interpreter threads, whose scheduling spreads its time far more than the recording costs, so the
recording's own parts are timed directly too: one `RequestLedger.window` call with windows on and off, and
building one search's timeline (`SearchContext.timeline`), median [min-max] of the repeats. A search on a real runtime takes
seconds (a SmolLM2 beam search of n = 16: about 45 s, docs/benchmarks.md), so the difference per search set against that
is the recording's overhead there. Building the timeline (`SearchContext.timeline`, once per search) is inside
the "on" time.
"""

from __future__ import annotations

import statistics
import time

from sgl_tts.measure.summary import median_range
from sgl_tts.measure.tables import Column, console_table

ARMS = ("off", "on")


def run_bench(searches: int = 40, repeats: int = 5, n: int = 16, beam_width: int = 4, max_steps: int = 4) -> int:
    from sgl_tts.problems import Problem
    from sgl_tts.runtime.hardware import cpu_summary
    from sgl_tts.search.api import Runtimes, SearchConfig
    from sgl_tts.search.programs import load_program
    from sgl_tts.testing import ScriptedBackend, ScriptedScorer

    program = load_program("beam_search")
    problems = [Problem(id=f"p{i}", question=f"what is {i} plus {i}?", gold=str(2 * i)) for i in range(searches)]
    configs = {arm: SearchConfig(program="beam_search", n=n, beam_width=beam_width, max_steps=max_steps,
                                 max_step_tokens=16, max_tokens=16 * max_steps, record_timeline=arm == "on")
               for arm in ARMS}
    per_search: dict[str, list[float]] = {arm: [] for arm in ARMS}
    windows: dict[str, list[float]] = {arm: [] for arm in ARMS}
    requests: list[int] = []
    print(f"bench timeline: beam search n={n} B={beam_width} steps<={max_steps} on the scripted backend, {searches} "
          f"searches per arm and repeat, {repeats} interleaved repeats; {cpu_summary()}", flush=True)
    for repeat in range(repeats):
        for arm in ARMS if repeat % 2 == 0 else reversed(ARMS):
            runtimes = Runtimes(generator=ScriptedBackend(), scorer=ScriptedScorer(), prompt=lambda q: f"Q: {q}\n\n")
            recorded = 0
            began = time.perf_counter()
            for problem in problems:
                context = runtimes.new_search(configs[arm], problem.id)
                result = program(problem, configs[arm], runtimes, context)
                recorded += len(result.extra["timeline"]["windows"]) if arm == "on" else 0
                requests.append(context.ledger.answered_count())
            per_search[arm].append(1000 * (time.perf_counter() - began) / searches)
            windows[arm].append(recorded / searches)
    import os
    import timeit

    from sgl_tts.frontend.ledger import RequestLedger

    calls = 20_000
    window_us = {arm: [1e6 * timeit.timeit(lambda: ledger.window("verify", "scorer", 1.0, 2.0, paths=4, steps=8),
                                           number=calls) / calls
                       for ledger in (RequestLedger(record_windows=arm == "on") for _ in range(repeats))]
                 for arm in ARMS}
    export_us = [1e6 * timeit.timeit(context.timeline, number=50) / 50 for _ in range(repeats)]
    rows = [[arm, median_range(per_search[arm], ".3f"), f"{statistics.median(windows[arm]):.0f}"] for arm in ARMS]
    print(f"load average {os.getloadavg()[0]:.2f}; {statistics.median(requests):.0f} requests per search")
    print(console_table((Column("timeline"), Column("ms per search"), Column("windows per search")), rows))
    extra_ms = statistics.median(per_search["on"]) - statistics.median(per_search["off"])
    per_window_us = 1000 * extra_ms / statistics.median(windows["on"]) if statistics.median(windows["on"]) else 0.0
    print(f"on - off: {extra_ms:+.3f} ms per search ({per_window_us:+.1f} us per recorded window, median of "
          f"medians; ranges as above)")
    print(f"timed directly: one window {median_range(window_us['on'], '.2f')} us on, "
          f"{median_range(window_us['off'], '.2f')} us off; one search's timeline built "
          f"({statistics.median(requests):.0f} requests, {statistics.median(windows['on']):.0f} windows) "
          f"{median_range(export_us, '.0f')} us")
    return 0
