"""The one-symbol libcuda stub that lets SGLang's CUDA-built kernel library load on a machine without CUDA.

The kernel library resolves `cuPointerGetAttribute` at load time. Our stub exports just that symbol and
answers CUDA_ERROR_NO_DEVICE (100), so the library loads and the CPU code paths run.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from sgl_tts.env_names import CACHE
from sgl_tts.paths import cache_dir

STUB_SOURCE = """\
/* sgl-tts CPU shim: no CUDA device is present. */
int cuPointerGetAttribute(void *data, int attribute, unsigned long long pointer) {
    (void)data; (void)attribute; (void)pointer;
    return 100; /* CUDA_ERROR_NO_DEVICE */
}
"""


class ShimBuildError(RuntimeError):
    """The stub could not be built; the message is one line saying why and what to do."""


def shim_dir() -> Path:
    """Build the stub once (idempotent) and return the folder to put first on LD_LIBRARY_PATH."""
    try:
        folder = cache_dir() / "cpu-shim"
        library = folder / "libcuda.so.1"
        source = folder / "libcuda_stub.c"
        if library.is_file() and source.is_file() and source.read_text() == STUB_SOURCE:
            return folder
        compiler = shutil.which("gcc") or shutil.which("cc")
        if compiler is None:
            raise ShimBuildError("building the CPU shim needs a C compiler: install gcc (apt-get install gcc)")
        partial = folder / "libcuda.so.1.partial"
        folder.mkdir(parents=True, exist_ok=True)
        source.write_text(STUB_SOURCE)
        proc = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(partial), str(source)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise ShimBuildError(f"compiling the CPU shim ({compiler} {source}) failed with exit code "
                                 f"{proc.returncode}: {_first_error_line(proc.stderr)}")
        partial.replace(library)
        return folder
    except OSError as exc:
        raise ShimBuildError(f"cannot build the CPU shim ({exc.strerror or exc}: {exc.filename}): make the cache "
                             f"folder writable or point {CACHE} at a writable one") from None


def _first_error_line(compiler_output: str) -> str:
    """The compiler's first line that says "error", else its last line (the error message stays one line)."""
    lines = [line.strip() for line in compiler_output.splitlines() if line.strip()]
    return next((line for line in lines if "error" in line.lower()), lines[-1] if lines else "no output")
