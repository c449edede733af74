"""A CPU runtime's start-up forked from the process's zygote (the default, sgl_tts/runtime/zygote.py) against
started afresh (`SGLTTS_RUNTIME_ZYGOTE=off`), side by side.

Each round starts one runtime of each arm in turn (the order alternating), waits until it answers a request
(`Runtime.start`), and stops it. The zygote's own start (its imports, once per process) is timed apart: it is
what the first runtime of a process pays. Prints seconds to ready per arm as the median [min-max] of the rounds
and the ratio of the medians, with the CPU model and the load.

    .venv/bin/python scripts/bench_startup.py [--rounds 5] [--model tiny-random]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from sgl_tts import env_names
from sgl_tts.runtime import zygote
from sgl_tts.runtime.hardware import cpu_summary
from sgl_tts.runtime.server import Runtime, RuntimeConfig, server_env

ARMS = {"forked": None, "afresh": zygote.OFF}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", default="tiny-random")
    args = parser.parse_args()
    configs = {arm: RuntimeConfig(model=args.model, device="cpu", max_total_tokens=4096, startup_timeout_s=600,
                                  env={env_names.RUNTIME_ZYGOTE: value} if value else {})
               for arm, value in ARMS.items()}
    began = time.perf_counter()
    started = zygote.start_for(server_env(configs["forked"]))
    print(f"the zygote's imports: {time.perf_counter() - began:.1f} s (once per process)", flush=True)
    seconds: dict[str, list[float]] = {arm: [] for arm in ARMS}
    load = [os.getloadavg()[0]]
    for round_number in range(args.rounds):
        for arm in (list(ARMS) if round_number % 2 == 0 else list(reversed(ARMS))):
            began = time.perf_counter()
            runtime = Runtime.start(configs[arm], name=f"startup-{arm}")
            seconds[arm].append(time.perf_counter() - began)
            runtime.stop()
            load.append(os.getloadavg()[0])
            print(f"round {round_number + 1} {arm:7s} ready in {seconds[arm][-1]:.1f} s "
                  f"({type(runtime.process).__name__})", flush=True)
    assert started is zygote.start_for(server_env(configs["forked"])), "the zygote was replaced during the bench"
    print(f"CPU: {cpu_summary()}; load average {min(load):.1f}-{max(load):.1f}")
    for arm, values in seconds.items():
        print(f"{arm:7s} median {statistics.median(values):5.1f} s [{min(values):.1f}-{max(values):.1f}]")
    print(f"afresh / forked: {statistics.median(seconds['afresh']) / statistics.median(seconds['forked']):.2f}x")


if __name__ == "__main__":
    main()
