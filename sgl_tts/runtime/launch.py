"""`python -m sgl_tts.runtime.launch ARGS`: SGLang's `launch_server ARGS`, its processes forked on a CPU.

SGLang starts the scheduler, the detokenizer and a data-parallel controller with its ranks as `spawn`ed
processes (`multiprocessing.set_start_method("spawn", force=True)` in `sglang.srt.entrypoints.engine`): a fresh
interpreter each, which imports SGLang, torch and transformers again. On a 2-core machine that import is most
of a runtime's start-up (about 9 s of CPU per process, several processes per runtime, all at once). `spawn` is
there for CUDA, which a forked child cannot use once its parent touched it; a CPU runtime's parent has not (it
tokenizes, it computes nothing with torch before it starts its children), so here the children are forked and
inherit the imports. SGLang's plugins load once per process (`load_plugins` is idempotent), so the hooks the
parent installed are the child's too. A CUDA runtime is launched by SGLang's own module, not this one.
"""

from __future__ import annotations

import multiprocessing
import runpy

FORK = "fork"


def fork_children(set_start_method=multiprocessing.set_start_method):
    """A `set_start_method` that makes every start method `fork`."""

    def forked(method: str | None, force: bool = False) -> None:
        set_start_method(FORK if method is not None else None, force=force)

    return forked


def main() -> None:
    multiprocessing.set_start_method = fork_children()
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
