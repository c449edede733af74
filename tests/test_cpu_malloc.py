"""Large blocks kept in the heap (policies/cpu_malloc.py): counted in the kernel's page faults, not in time. A block
of 32 MB (a decode step's logits are 25 MB at 128 rows) allocated, written and freed five times: with glibc's own
thresholds each round maps it afresh and faults on every page; with `reuse_large_blocks` the rounds after the first
reuse it."""

import subprocess
import sys

import pytest

from policies import cpu_malloc

ROUNDS = """
import ctypes, ctypes.util, resource, sys
from policies import cpu_malloc
if sys.argv[1] == "reuse":
    assert cpu_malloc.reuse_large_blocks()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = 32 << 20
faults = []
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(" ".join(map(str, faults)))
"""


def faults_per_round(mode: str) -> list[int]:
    result = subprocess.run([sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True, check=True)
    return [int(x) for x in result.stdout.split()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_freed_large_block_is_reused_without_faulting_its_pages_again():
    pages = (32 << 20) // 4096
    system, reuse = faults_per_round("system"), faults_per_round("reuse")
    assert min(system[1:]) > pages // 2, f"glibc maps a freed 32 MB block afresh: {system}"
    assert reuse[0] > pages // 2, f"the first round faults its pages in: {reuse}"
    assert max(reuse[1:]) < pages // 20, f"later rounds reuse the block: {reuse}"


def test_the_plugin_value_is_the_one_cpu_runtimes_get():
    from sgl_tts import env_names
    from sgl_tts.runtime.server import RuntimeConfig, server_env

    assert server_env(RuntimeConfig(device="cpu"))[env_names.CPU_MALLOC] == cpu_malloc.REUSE
    kept = RuntimeConfig(device="cpu", env={env_names.CPU_MALLOC: "system"})
    assert server_env(kept)[env_names.CPU_MALLOC] == "system"


def test_the_plugin_sets_them_in_the_scheduler_when_asked():
    """register() in a process of its own (the thresholds are the process's): it says so in the server's log."""
    import os

    from sgl_tts import env_names

    env = {k: v for k, v in os.environ.items() if not k.startswith((env_names.PREFIX, env_names.OLD_PREFIX))}
    said = {}
    for value in ("reuse", "system"):
        result = subprocess.run([sys.executable, "-c", "from policies import plugin; plugin.register()"],
                                env={**env, env_names.CPU_MALLOC: value}, capture_output=True, text=True, check=True)
        said[value] = "large blocks kept in the heap for reuse" in result.stderr
    assert said == {"reuse": True, "system": False}
