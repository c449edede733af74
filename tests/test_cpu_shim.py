"""The CPU shim: it builds and answers CUDA_ERROR_NO_DEVICE; a failed build is one clear line from the CLI and set-up."""

import ctypes

import pytest

from sgl_tts.runtime import cpu_shim, provision
from sgl_tts.runtime.cpu_shim import ShimBuildError, shim_dir


@pytest.fixture
def shim_cache(tmp_path, monkeypatch):
    """The shim is built into a fresh cache folder, not the shared one."""
    monkeypatch.setattr(cpu_shim, "cache_dir", lambda: tmp_path)
    return tmp_path


def test_the_shim_builds_and_reports_no_device(shim_cache):
    folder = shim_dir()
    assert folder == shim_cache / "cpu-shim"
    library = ctypes.CDLL(str(folder / "libcuda.so.1"))
    library.cuPointerGetAttribute.restype = ctypes.c_int
    assert library.cuPointerGetAttribute(None, 0, ctypes.c_ulonglong(0)) == 100  # CUDA_ERROR_NO_DEVICE
    assert shim_dir() == folder, "a second call reuses the built library"


def test_a_compile_error_is_one_line_with_the_compiler_message(shim_cache, monkeypatch):
    monkeypatch.setattr(cpu_shim, "STUB_SOURCE", "int cuPointerGetAttribute(void *data {\n")
    with pytest.raises(ShimBuildError) as info:
        shim_dir()
    message = str(info.value)
    assert "\n" not in message
    assert "compiling the CPU shim" in message and "failed with exit code" in message and "error" in message
    assert not (shim_cache / "cpu-shim" / "libcuda.so.1").exists()


def test_no_compiler_and_an_unwritable_cache_are_clear(shim_cache, monkeypatch):
    monkeypatch.setattr(cpu_shim.shutil, "which", lambda name: None)
    with pytest.raises(ShimBuildError, match=r"needs a C compiler: install gcc"):
        shim_dir()
    monkeypatch.undo()
    blocker = shim_cache / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setattr(cpu_shim, "cache_dir", lambda: blocker)  # mkdir under a file fails, even as root
    with pytest.raises(ShimBuildError, match=r"cannot build the CPU shim .*not-a-folder.*SGLTTS_CACHE"):
        shim_dir()


def _break_the_compiler(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_shim, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(cpu_shim.shutil, "which", lambda name: None)


def test_the_cli_prints_one_error_line_and_exits_non_zero(tmp_path, monkeypatch, capsys):
    from sgl_tts.cli import main

    config = tmp_path / "run.yaml"
    config.write_text("generator: {model: tiny-random, device: cpu}\nscorer: {kind: likelihood}\n"
                      "search: {program: best_of_n, n: 1}\ndataset: {name: builtin, limit: 1}\n")
    _break_the_compiler(monkeypatch, tmp_path)
    assert main(["run", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err == "sgl-tts: error: building the CPU shim needs a C compiler: install gcc (apt-get install gcc)\n"


def test_setup_prints_one_error_line_and_exits_non_zero(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(provision, "provision_smollm2", lambda: tmp_path / "smollm2")
    monkeypatch.setattr(provision, "provision_tiny_random", lambda: tmp_path / "tiny")
    _break_the_compiler(monkeypatch, tmp_path)
    assert provision.main() == 1
    captured = capsys.readouterr()
    assert captured.err == "setup: error: building the CPU shim needs a C compiler: install gcc (apt-get install gcc)\n"
    assert "setup: model tiny-random at" in captured.out and "ready" not in captured.out
