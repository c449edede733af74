"""`python -m sgl_tts.runtime.provision`: build what the CPU default needs (models, shim, the paged attention
kernel, the norm and rotary kernels, the products on 4- and 8-bit weights and on AMX tiles, the compiled decode step
and the sampler's draw); idempotent.

A failure prints one line, `setup: error: ...`, and exits with status 1 (scripts/setup.sh stops there).
"""

from __future__ import annotations

import sys
import time

from policies.cpu_attention import paged_kernel
from policies.cpu_layers import layer_kernels
from policies.cpu_linear import amx_kernels, grid_kernels
from policies.cpu_sampling import sampling_kernel
from policies.lean_decode import step_kernel
from sgl_tts.runtime.cpu_shim import ShimBuildError, shim_dir
from sgl_tts.runtime.models import ModelNotFoundError, provision_smollm2, provision_tiny_random


def provision() -> None:
    began = time.monotonic()
    print(f"setup: model smollm2-135m at {provision_smollm2()}", flush=True)
    print(f"setup: model tiny-random at {provision_tiny_random()}", flush=True)
    print(f"setup: CPU shim at {shim_dir()}", flush=True)
    # built here, not by a runtime's first decode step (about 40 s on one core); a failure is not fatal
    built = paged_kernel() is not None
    print(f"setup: paged attention kernel {'built' if built else 'not built: batched_decode runs instead'}", flush=True)
    layers = "built" if layer_kernels() is not None else "not built: SGLang's torch versions run instead"
    print(f"setup: norm and rotary kernels {layers}", flush=True)
    grids = "built" if grid_kernels() is not None else "not built: every weight is read from its packed copy"
    print(f"setup: 4- and 8-bit weight products {grids}", flush=True)
    tiles = "built" if amx_kernels() is not None else "not used: no AMX on this CPU, or not built (oneDNN's instead)"
    print(f"setup: AMX tile products {tiles}", flush=True)
    step = "built" if step_kernel() is not None else "not built: the decode step's loop runs in Python"
    print(f"setup: compiled decode step {step}", flush=True)
    draw = "built" if sampling_kernel() is not None else "not built: the draw runs in torch"
    print(f"setup: sampling kernel {draw}", flush=True)
    print(f"setup: ready ({time.monotonic() - began:.1f} s)")


def main() -> int:
    try:
        provision()
    except (ShimBuildError, ModelNotFoundError) as exc:
        print(f"setup: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
