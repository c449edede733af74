"""`sgl-tts bench runtime|fasttts|verifier|serve|peers|coexist|timeline`: benchmarks that print side-by-side ratios (`sgl_tts.bench`)."""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex

from sgl_tts.bench.coexist import SEVERAL, SWITCH_ARMS, CoexistArm
from sgl_tts.bench.fasttts import ARMS as FASTTTS_ARMS
from sgl_tts.bench.fasttts import BUDGET_FRACTIONS, CONCURRENCY, NS
from sgl_tts.bench.fasttts import PROGRAMS as FASTTTS_PROGRAMS
from sgl_tts.bench.policy import SIZES as POLICY_SIZES
from sgl_tts.bench.runtime import HF_ARM, RuntimeArm

_ENV_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


def parse_arm(text: str) -> RuntimeArm:
    """`--arm NAME=ARGS`: ARGS split like a shell line, leading VAR=value words as environment (may be empty:
    the defaults)."""
    name, sep, args = text.partition("=")
    name = name.strip()
    if not sep or name == HF_ARM or not re.fullmatch(r"[\w.+-]+", name):
        raise argparse.ArgumentTypeError(f"--arm {text!r}: expected NAME=ARGS with a NAME (letters, digits, ._+-) "
                                         f"other than {HF_ARM!r}, e.g. 'steps4=--num-continuous-decode-steps 4' "
                                         f"or 'default='")
    words = shlex.split(args)
    env = []
    while words and _ENV_WORD.match(words[0]):
        key, _, value = words.pop(0).partition("=")
        env.append((key, value))
    return RuntimeArm(name, tuple(words), tuple(env))


def parse_coexist_arm(text: str) -> CoexistArm:
    """`--arm NAME=KEY=VALUE,KEY=VALUE`: "search x1" with run-config keys set (`search.n=4`,
    `fasttts.speculative=true`, `concurrency=2`, `search.settings.tau=0.6`); each VALUE read as YAML, a comma
    before the next KEY= ends it. The keys are checked against the run config when the bench starts."""
    name, sep, assignments = text.partition("=")
    name = name.strip()
    if not sep or not re.fullmatch(r"[\w.+-]+", name) or not assignments.strip():
        raise argparse.ArgumentTypeError(f"--arm {text!r}: expected NAME=KEY=VALUE[,KEY=VALUE...], e.g. "
                                         f"'budget=search.n=4' or 'two=concurrency=2,fasttts.prefix_order=true'")
    import yaml

    overrides = []
    for assignment in re.split(r",(?=\s*[A-Za-z_][\w.]*=)", assignments):
        key, equals, value = assignment.partition("=")
        key = key.strip()
        if not equals or not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", key):
            raise argparse.ArgumentTypeError(f"--arm {text!r}: {assignment!r} is not KEY=VALUE with a dotted KEY")
        try:
            overrides.append((key, yaml.safe_load(value) if value.strip() else None))
        except yaml.YAMLError as exc:
            raise argparse.ArgumentTypeError(f"--arm {text!r}: {key}: {value!r} is not a YAML value ({exc})")
    concurrency = dict(overrides).get("concurrency", 1)
    if not isinstance(concurrency, int) or isinstance(concurrency, bool) or concurrency < 1:
        raise argparse.ArgumentTypeError(f"--arm {text!r}: concurrency must be a whole number >= 1")
    return CoexistArm(name, concurrency=concurrency, overrides=tuple((k, v) for k, v in overrides
                                                                     if k != "concurrency"))


def add_parsers(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="benchmarks that print side-by-side ratios")
    bench_commands = bench.add_subparsers(dest="bench", required=True)

    parser = bench_commands.add_parser("runtime", help="SGLang CPU runtime settings vs HF generate and the bare torch "
                                                       "forward loop (tokens/s ratios, first token, step split)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--parallel", default="1,8,16,64", help="comma-separated request counts")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; every arm runs once per round, interleaved")
    parser.add_argument("--arm", type=parse_arm, action="append",
                        help="NAME=ARGS: an SGLang arm with extra launch_server arguments (repeatable; "
                             "default: one arm 'default' with the CPU defaults)")
    parser.add_argument("--threads", type=int, help="torch threads in each SGLang scheduler process")
    parser.add_argument("--max-total-tokens", type=int, default=16384,
                        help="KV tokens of each SGLang arm (they run side by side in host memory)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy; above 0: SGLang and HF sample the whole vocabulary at this temperature "
                             "(the CPU default searches at 0.3)")
    parser.add_argument("--hf-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the dtype of the HF generate and torch loop references")
    parser.set_defaults(func=bench_runtime)

    parser = bench_commands.add_parser("fasttts", help="FastTTS by the paper's protocol: one search at a time, "
                                                       "n = 16, 64, 256, baseline vs P, P+M, P+M+S, all "
                                                       "(Fig. 12, 13, 16)")
    parser.add_argument("--config", default="cpu-default",
                        help="run config (YAML path or packaged name): models, verifier")
    parser.add_argument("--quick", action="store_true",
                        help="beam search, n=16, baseline vs all, 3 problems, 3 repeats")
    parser.add_argument("--programs", default=None, help=f"comma-separated (default {','.join(FASTTTS_PROGRAMS)})")
    parser.add_argument("--ns", default=None,
                        help=f"comma-separated beam counts n (default {NS}, the paper's range; n = 256 takes long "
                             f"on a CPU: cut it with e.g. --ns 16,64)")
    parser.add_argument("--arms", default=None,
                        help=f"comma-separated arms (default {','.join(FASTTTS_ARMS)}; V, verifier prefix reuse "
                             f"alone, on request)")
    parser.add_argument("--problems", type=int, default=None, help="bundled problems per cell (default 5)")
    parser.add_argument("--repeats", type=int, default=None, help="runs of every cell, interleaved (default 3)")
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY,
                        help=f"searches at once (default {CONCURRENCY}: the paper's batch size of one)")
    parser.add_argument("--budget-fraction", default=BUDGET_FRACTIONS,
                        help=f"KV budget of each n as comma-separated fractions of its working set (generator + "
                             f"verifier), one cell each (default {BUDGET_FRACTIONS}: memory-bound at every n; "
                             f"1.0 holds it all)")
    parser.add_argument("--beam-width", type=int, default=4, help="children per kept beam (B)")
    parser.add_argument("--max-steps", type=int, default=3)
    parser.add_argument("--max-step-tokens", type=int, default=24)
    parser.add_argument("--step-delimiter", default="\\n",
                        help="step delimiter, escapes allowed (default \\n: SmolLM2 writes a step per line)")
    parser.add_argument("--kv-budget-mib", type=float, default=None,
                        help="a fixed KV budget for generator and verifier at every n, instead of "
                             "--budget-fraction of the working set")
    parser.add_argument("--hardware", default="this-machine", help="roofline profile for M")
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help="prompt length for the plan and floors (default: the problems' longest prompt)")
    parser.add_argument("--max-speculative", type=int, default=None, help="cap on one search's speculative requests")
    parser.add_argument("--engine-batch", type=int, default=None,
                        help="speculate only while the generator runs fewer requests than this (default: the "
                             "sequences of one step's length the generator's KV holds, on a CPU at most 2)")
    parser.add_argument("--live-sessions", type=int, default=2,
                        help="runtime sets kept alive between cells (fewer when the host's free memory would not "
                             "hold another)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", default=None, help="runtime logs (default: a temporary folder)")
    parser.add_argument("--out", default=None,
                        help="folder for the JSON of every run, the Markdown table and the Fig. 12/13 plots")
    parser.add_argument("--merge", default=None,
                        help="comma-separated bench-fasttts.json files of earlier runs (e.g. one per n): report "
                             "and plot their cells together, running nothing")
    parser.set_defaults(func=bench_fasttts)

    parser = bench_commands.add_parser("policy", help="prefix-aware ordering (P) at 256 to 4,096 waiting requests: "
                                                      "microseconds per request, interleaved repeats")
    parser.add_argument("--sizes", default=",".join(map(str, POLICY_SIZES)),
                        help="comma-separated waiting-queue sizes")
    parser.add_argument("--repeats", type=int, default=15, help="rounds; every size once per round, interleaved")
    parser.add_argument("--beam-width", type=int, default=4, help="children per parent (B)")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=bench_policy)

    parser = bench_commands.add_parser("verifier", help="full re-scoring vs incremental step scoring")
    parser.add_argument("--config", default="configs/cpu-default.yaml", help="run config (YAML): models, verifier")
    parser.add_argument("--problems", type=int, default=2, help="bundled problems per arm and repeat")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions of each arm, interleaved")
    parser.add_argument("--n", type=int, default=8, help="beams")
    parser.add_argument("--beam-width", type=int, default=4, help="children per kept beam")
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--max-step-tokens", type=int, default=32)
    parser.add_argument("--step-delimiter", default="\\n",
                        help="step delimiter, escapes allowed (default \\n: SmolLM2 writes a step per line)")
    parser.add_argument("--log-dir", default=None, help="runtime logs (default: a temporary folder)")
    parser.add_argument("--out", default=None, help="write every scorer call's counts as JSON here")
    parser.set_defaults(func=bench_verifier)

    parser = bench_commands.add_parser("coexist", help="searches beside a 50 Hz control loop with deadlines: its "
                                                       "misses, jitter, CPU and memory per arm, recovery after a "
                                                       "cancel, the machine's state")
    parser.add_argument("--config", default="cpu-default", help="run config (YAML path or packaged name)")
    parser.add_argument("--program", default="beam_search")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--max-steps", type=int, default=3)
    parser.add_argument("--max-step-tokens", type=int, default=24)
    parser.add_argument("--step-delimiter", default="\\n", help="step delimiter, escapes allowed (default \\n)")
    parser.add_argument("--several", type=int, default=SEVERAL,
                        help=f"searches at once in 'search xC' and the cancel (default {SEVERAL})")
    parser.add_argument("--rounds", type=int, default=1,
                        help="searches per worker (C workers, one search each at a time) per inference arm, at least")
    parser.add_argument("--arm-s", type=float, default=10.0,
                        help="an inference arm's workers start searches until this many seconds have passed")
    parser.add_argument("--idle-s", type=float, default=10.0, help="length of the no-inference arm")
    parser.add_argument("--repeats", type=int, default=2, help="runs of every arm, interleaved")
    parser.add_argument("--arms", default=None,
                        help=f"comma-separated standard arms (default all: idle, x1, xC, {', '.join(SWITCH_ARMS)})")
    parser.add_argument("--arm", type=parse_coexist_arm, action="append", default=[],
                        help="NAME=KEY=VALUE,...: one more arm, 'search x1' with run-config keys set (repeatable), "
                             "e.g. a search budget: 'budget=search.<key>=<value>'")
    parser.add_argument("--no-cancel", dest="cancel", action="store_false",
                        help="skip the cancel-and-recover run after each repeat")
    parser.add_argument("--cancel-after-s", type=float, default=0.5,
                        help="cancel the searches this long after they start, or later once one has requests in "
                             "flight (a cancel after every search ended shows 0 in flight)")
    parser.add_argument("--watch-s", type=float, default=8.0, help="seconds of the loop watched after a cancel")
    parser.add_argument("--period-ms", type=float, default=20.0, help="the loop's period (default 20: 50 Hz)")
    parser.add_argument("--work-fraction", type=float, default=0.3,
                        help="the loop's work as a fraction of its period on an idle core")
    parser.add_argument("--live-sessions", type=int, default=2, help="runtime sets kept alive between arms")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", default=None, help="runtime logs (default: a temporary folder)")
    parser.add_argument("--out", default=None, help="folder for bench-coexist.json and bench-coexist.md")
    parser.set_defaults(func=bench_coexist)

    parser = bench_commands.add_parser("timeline", help="the cost of recording a search's timeline: scripted "
                                                        "beam searches with record_timeline off and on")
    parser.add_argument("--searches", type=int, default=40, help="searches per arm and repeat")
    parser.add_argument("--repeats", type=int, default=5, help="rounds; both arms once per round, interleaved")
    parser.add_argument("--n", type=int, default=16)
    parser.set_defaults(func=bench_timeline)

    parser = bench_commands.add_parser("serve", help="concurrent clients against `sgl-tts serve`, 1 vs 2 replicas")
    parser.add_argument("--config", default="configs/serve-tiny.yaml", help="run config (YAML)")
    parser.add_argument("--program", help="search program (default: the config's)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients (C)")
    parser.add_argument("--requests", type=int, default=2, help="requests per client (R)")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2], help="generator replica counts")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of each arm (interleaved)")
    parser.set_defaults(func=bench_serve)

    parser = bench_commands.add_parser("peers", help="its-hub and optillm against sgl-tts's programs on the same "
                                                     "SGLang runtimes: accuracy, time, tokens, requests, frontiers "
                                                     "(needs `make peers`)")
    parser.add_argument("--config", default="cpu-default",
                        help="run config (YAML path or packaged name): models, PRM, search settings, dataset")
    parser.add_argument("--systems", default=None, help="comma-separated system names (default: all)")
    parser.add_argument("--algorithms", default=None,
                        help="comma-separated: self_consistency, best_of_n, step_search (default: all)")
    parser.add_argument("--ns", default="1,2,4,8,16", help="comma-separated n values")
    parser.add_argument("--peer-ns", default=None,
                        help="comma-separated n values of its-hub's and optillm's systems (default: --ns)")
    parser.add_argument("--problems", type=int, default=80, help="problems of the config's dataset")
    parser.add_argument("--offset", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=None, help="default: the config's")
    parser.add_argument("--max-step-tokens", type=int, default=None, help="default: the config's")
    parser.add_argument("--max-tokens", type=int, default=None, help="default: the config's")
    parser.add_argument("--step-delimiter", default=None, help="escapes allowed (default: the config's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stopping", default=None,
                        help="stopping rules beneath sgl-tts's programs, a YAML mapping of search.stopping's keys, "
                             "e.g. '{rule: settled, consensus: 0.1, min_answers: 1, agree: 2, programs: [best_of_n]}' "
                             "(default: the config's)")
    parser.add_argument("--out", default="bench-peers",
                        help="folder of peers.jsonl (resumed when it exists), peers.md and the frontier plots")
    parser.add_argument("--log-dir", default=None, help="runtime logs (default: a temporary folder)")
    parser.add_argument("--report-only", action="store_true", help="report --out's results, run nothing")
    parser.set_defaults(func=bench_peers)


def options_from(args: argparse.Namespace, options_class: type) -> object:
    """The options dataclass filled from the parsed arguments of the same names."""
    return options_class(**{field.name: getattr(args, field.name) for field in dataclasses.fields(options_class)})


def bench_runtime(args: argparse.Namespace) -> int:
    from sgl_tts.bench.runtime import run_bench

    return run_bench(model=args.model, new_tokens=args.new_tokens,
                     parallel=[int(p) for p in args.parallel.split(",")], repeats=args.repeats, arms=args.arm,
                     threads=args.threads, max_total_tokens=args.max_total_tokens, temperature=args.temperature,
                     hf_dtype=args.hf_dtype)


def bench_fasttts(args: argparse.Namespace) -> int:
    from sgl_tts.bench.fasttts import BenchOptions, run_bench

    return run_bench(options_from(args, BenchOptions))


def bench_policy(args: argparse.Namespace) -> int:
    from sgl_tts.bench.policy import run_bench

    return run_bench(sizes=[int(size) for size in args.sizes.split(",")], repeats=args.repeats,
                     beam_width=args.beam_width, seed=args.seed)


def bench_verifier(args: argparse.Namespace) -> int:
    from sgl_tts.bench.verifier_scoring import BenchOptions, run_bench

    return run_bench(options_from(args, BenchOptions))


def bench_serve(args: argparse.Namespace) -> int:
    from sgl_tts.bench.serve import run_bench

    return run_bench(config=args.config, program=args.program, clients=args.clients, requests=args.requests,
                     replicas=args.replicas, repeats=args.repeats)


def bench_peers(args: argparse.Namespace) -> int:
    from eval.peers import PeersOptions, run_peers

    return run_peers(options_from(args, PeersOptions))


def bench_coexist(args: argparse.Namespace) -> int:
    from sgl_tts.bench.coexist import BenchOptions, run_bench

    options = options_from(args, BenchOptions)
    return run_bench(dataclasses.replace(options, arm=tuple(args.arm)))


def bench_timeline(args: argparse.Namespace) -> int:
    from sgl_tts.bench.timeline import run_bench

    return run_bench(searches=args.searches, repeats=args.repeats, n=args.n)
