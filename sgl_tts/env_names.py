"""The environment variables sgl-tts reads, and `read` to read one.

Every name starts with `SGLTTS_`: SGLang takes any `SGL_*` variable for an old spelling of one of its own
`SGLANG_*` variables and warns about it on start-up. The earlier `SGL_TTS_*` spellings still work for one
release: `read` falls back to one when the new name is unset or empty, and says once per process on stderr
which variable replaces it. Standard library only: the scheduler plugin (policies/plugin.py) reads these
inside SGLang's scheduler process.
"""

from __future__ import annotations

import os
import sys
from typing import Mapping

PREFIX = "SGLTTS_"
OLD_PREFIX = "SGL_TTS_"  # the spelling before SGLTTS_, still read for one release

CACHE = "SGLTTS_CACHE"  # the cache root (sgl_tts.paths.cache_dir); scripts/setup.sh reads it too
DATA = "SGLTTS_DATA"  # the data root of the datasets (sgl_tts.problems)
API_KEY = "SGLTTS_API_KEY"  # `sgl-tts serve`'s API key when --api-key is not given
POLICY = "SGLTTS_POLICY"  # the scheduler policy the plugin installs (policies/plugin.py)
POLICY_TRACE = "SGLTTS_POLICY_TRACE"  # a file the plugin appends each reordered queue to (tests)
CPU_ATTENTION = "SGLTTS_CPU_ATTENTION"  # "paged" or "batched": the decode attention of policies/cpu_attention.py
CPU_LINEAR = "SGLTTS_CPU_LINEAR"  # "packed": the plugin's oneDNN linear layers (policies/cpu_linear.py), "packed-bf16"
# on bf16 weights, "packed-bf16-int4" / "packed-int4": bf16 / fp32, and 4- or 8-bit-grid weights from those bits at a
# few rows
CPU_LAYERS = "SGLTTS_CPU_LAYERS"  # "fused": compiled RMSNorm and rotary embedding (policies/cpu_layers.py)
CPU_DECODE = "SGLTTS_CPU_DECODE"  # "lean": a Llama decode step as one loop over the kernels (policies/lean_decode.py)
DP_PLACEMENT = "SGLTTS_DP_PLACEMENT"  # "search": a run's requests on one DP rank (policies/search_placement.py)
CORE_LENDING = "SGLTTS_CORE_LENDING"  # "on": an idle DP rank's core lent to a working one while other processes
# leave the cores free, "always": whatever they do (policies/core_lending.py)
CPU_SAMPLING = "SGLTTS_CPU_SAMPLING"  # "cdf": the plugin's inverse-CDF token sampling (policies/cpu_sampling.py)
CPU_DENORMALS = "SGLTTS_CPU_DENORMALS"  # "flush": denormal floats to zero in the scheduler (policies/cpu_sampling.py)
CPU_MALLOC = "SGLTTS_CPU_MALLOC"  # "reuse": large blocks kept in the scheduler's heap (policies/cpu_malloc.py)
PROBE_HEAD = "SGLTTS_PROBE_HEAD"  # a probe head file a generator computes margins of (policies/probe_readout.py)
STEP_TRACE = "SGLTTS_STEP_TRACE"  # a file the plugin appends each scheduler step's timing to (policies/step_timing.py)
EVAL_TAG = "SGLTTS_EVAL_TAG"  # tests: marks the processes an eval test starts, to find leftovers
NOTEBOOK_MODEL = "SGLTTS_NOTEBOOK_MODEL"  # the model notebooks/quickstart.ipynb runs
NOTEBOOK_TAG = "SGLTTS_NOTEBOOK_TAG"  # tests: marks the processes a notebook test starts
RUNTIME_ZYGOTE = "SGLTTS_RUNTIME_ZYGOTE"  # "off": CPU runtimes started afresh, not forked (sgl_tts/runtime/zygote.py)

NAMES = (CACHE, DATA, API_KEY, POLICY, POLICY_TRACE, CPU_ATTENTION, CPU_LINEAR, CPU_LAYERS, CPU_DECODE, CPU_SAMPLING,
         CPU_DENORMALS, CPU_MALLOC, DP_PLACEMENT, CORE_LENDING, PROBE_HEAD, STEP_TRACE,
         EVAL_TAG, NOTEBOOK_MODEL, NOTEBOOK_TAG, RUNTIME_ZYGOTE)

_warned: set[str] = set()  # old names already warned about in this process


def old_name(name: str) -> str:
    """The `SGL_TTS_*` spelling of `name`, read when `name` is not set."""
    return OLD_PREFIX + name.removeprefix(PREFIX)


def read(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The value of `name` in `environ` (default `os.environ`); when it is unset or empty, that of its old
    spelling, with a one-line deprecation message on stderr (once per name and process); None when neither
    is set to a non-empty value."""
    environ = os.environ if environ is None else environ
    if environ.get(name):
        return environ[name]
    old = old_name(name)
    if not environ.get(old):
        return None
    if old not in _warned:
        _warned.add(old)
        print(f"sgl-tts: environment variable {old} is deprecated and will stop working in the next release; "
              f"set {name} instead", file=sys.stderr, flush=True)
    return environ[old]


def cache_root() -> str:
    """The cache root's path: $SGLTTS_CACHE, else ~/.cache/sgl-tts (`sgl_tts.paths.cache_dir` makes it)."""
    return read(CACHE) or os.path.join(os.path.expanduser("~"), ".cache", "sgl-tts")
