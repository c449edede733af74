"""`python -m sgl_tts.runtime.provision`: build what the CPU default needs (models, shim); idempotent."""

from __future__ import annotations

import time

from sgl_tts.runtime.cpu_shim import shim_dir
from sgl_tts.runtime.models import provision_smollm2, provision_tiny_random


def main() -> None:
    began = time.monotonic()
    print(f"setup: model smollm2-135m at {provision_smollm2()}")
    print(f"setup: model tiny-random at {provision_tiny_random()}")
    print(f"setup: CPU shim at {shim_dir()}")
    print(f"setup: ready ({time.monotonic() - began:.1f} s)")


if __name__ == "__main__":
    main()
