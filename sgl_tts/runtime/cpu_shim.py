"""The one-symbol libcuda stub that lets SGLang's CUDA-built kernel library load on a machine without CUDA.

The kernel library resolves `cuPointerGetAttribute` at load time. Our stub exports just that symbol and
answers CUDA_ERROR_NO_DEVICE (100), so the library loads and the CPU code paths run.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from sgl_tts.paths import cache_dir

STUB_SOURCE = """\
/* sgl-tts CPU shim: no CUDA device is present. */
int cuPointerGetAttribute(void *data, int attribute, unsigned long long pointer) {
    (void)data; (void)attribute; (void)pointer;
    return 100; /* CUDA_ERROR_NO_DEVICE */
}
"""


class ShimBuildError(RuntimeError):
    pass


def shim_dir() -> Path:
    """Build the stub once (idempotent) and return the folder to put first on LD_LIBRARY_PATH."""
    folder = cache_dir() / "cpu-shim"
    library = folder / "libcuda.so.1"
    source = folder / "libcuda_stub.c"
    if library.is_file() and source.is_file() and source.read_text() == STUB_SOURCE:
        return folder
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise ShimBuildError("building the CPU shim needs a C compiler: install gcc (apt-get install gcc)")
    folder.mkdir(parents=True, exist_ok=True)
    source.write_text(STUB_SOURCE)
    partial = folder / "libcuda.so.1.partial"
    proc = subprocess.run(
        [compiler, "-shared", "-fPIC", "-O2", "-o", str(partial), str(source)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise ShimBuildError(f"compiling the CPU shim failed:\n{proc.stderr}")
    partial.replace(library)
    return folder
