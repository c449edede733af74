"""sgl-tts's environment variables stay out of SGLang's namespace, and their old spellings still work."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sgl_tts import env_names
from sgl_tts.env_names import CACHE, NAMES, PREFIX, old_name, read
from sgl_tts.paths import cache_dir

REPO = Path(__file__).resolve().parents[1]
SGLANG_PREFIXES = ("SGL_", "SGLANG_")  # SGLang reads every SGL_* variable as an old spelling of an SGLANG_* one
SGLANG_OWN = {"SGLANG_USE_CPU_ENGINE", "SGLANG_EXTERNAL_MODEL_PACKAGE", "SGLANG_TIMEOUT_KEEP_ALIVE",  # set on purpose
              "SGLANG_CPU_OMP_THREADS_BIND", "SGLANG_PYSPY_DUMP_BEFORE_CRASH", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH"}
OLD_SPELLING_READERS = {"sgl_tts/env_names.py", "scripts/setup.sh"}  # read the old names for one release
SOURCE_SUFFIXES = (".py", ".ipynb", ".sh", ".yaml", ".yml", ".toml", ".md", "Makefile")

_NAME = r"((?:SGL|SGLANG)_[A-Z0-9][A-Z0-9_]*)"
_PYTHON_NAME = re.compile(rf"[\"']{_NAME}[\"']")  # a string literal: os.environ[...], setenv(...), env={...}
_OTHER_NAME = re.compile(rf"[\"']{_NAME}[\"']|\$\{{?{_NAME}|\b{_NAME}\s*[=:]")  # also $X, ${X...}, X=..., key X:


def source_files():
    for folder, subfolders, files in os.walk(REPO):  # a symlinked folder (.venv) is listed, not entered
        subfolders[:] = [d for d in subfolders if not d.startswith(".") and not d.endswith(".egg-info")
                         and d != "__pycache__"]
        for name in files:
            if name.endswith(SOURCE_SUFFIXES):
                yield Path(folder, name)


def environment_names_in(path):
    pattern = _PYTHON_NAME if path.suffix in (".py", ".ipynb") else _OTHER_NAME
    return {name for match in pattern.finditer(path.read_text(errors="replace")) for name in match.groups() if name}


def test_no_variable_of_ours_is_in_sglangs_namespace():
    assert all(name.startswith(PREFIX) and not name.startswith(SGLANG_PREFIXES) for name in NAMES)
    strays = {}
    for path in source_files():
        where = path.relative_to(REPO).as_posix()
        for name in environment_names_in(path) - SGLANG_OWN:
            if not (name.startswith(env_names.OLD_PREFIX) and where in OLD_SPELLING_READERS):
                strays.setdefault(name, []).append(where)
    assert strays == {}, "an environment variable of ours starts with SGL_ or SGLANG_: use sgl_tts.env_names"


def sglang_environ_warnings(environ):
    """The warnings SGLang's environment check (sglang/srt/environ.py, run at import) gives for `environ`: the
    module is run on its own (it needs only the standard library) in a child process, so neither SGLang's
    heavy package import nor its rewriting of os.environ touches this one."""
    spec = importlib.util.find_spec("sglang")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sglang is not installed")
    environ_py = Path(spec.submodule_search_locations[0]) / "srt" / "environ.py"
    script = ("import importlib.util, json, sys, warnings\n"
              "spec = importlib.util.spec_from_file_location('sglang_environ', sys.argv[1])\n"
              "with warnings.catch_warnings(record=True) as caught:\n"
              "    warnings.simplefilter('always')\n"
              "    spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
              "print(json.dumps([str(w.message) for w in caught]))\n")
    done = subprocess.run([sys.executable, "-c", script, str(environ_py)], env={"PATH": os.environ["PATH"], **environ},
                          capture_output=True, text=True, check=True, timeout=60)
    return json.loads(done.stdout)


def test_sglang_warns_about_the_old_names_and_not_about_ours():
    ours = {name: "x" for name in NAMES}
    assert [message for message in sglang_environ_warnings(ours) if any(name in message for name in NAMES)] == []
    old = old_name(CACHE)
    assert any(old in message and "is deprecated" in message
               for message in sglang_environ_warnings({**ours, old: "x"})), "the check no longer sees the old names"


@pytest.fixture
def fresh_warnings(monkeypatch):
    """No name warned about yet in this process, and neither spelling of CACHE set."""
    monkeypatch.setattr(env_names, "_warned", set())
    for name in (CACHE, old_name(CACHE)):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_an_old_name_still_works_and_warns_once_naming_the_new_one(fresh_warnings, tmp_path, capsys):
    fresh_warnings.setenv(old_name(CACHE), str(tmp_path))
    assert cache_dir() == tmp_path and cache_dir() == tmp_path
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and old_name(CACHE) in lines[0] and f"set {CACHE} instead" in lines[0]


def test_the_new_name_wins_without_a_warning(fresh_warnings, tmp_path, capsys):
    fresh_warnings.setenv(CACHE, str(tmp_path / "new"))
    fresh_warnings.setenv(old_name(CACHE), str(tmp_path / "old"))
    assert cache_dir() == tmp_path / "new"
    assert read(CACHE, {}) is None and read(CACHE, {CACHE: ""}) is None
    assert capsys.readouterr().err == ""


def test_setup_reads_the_old_cache_name_warns_and_passes_it_on_as_the_new_one(tmp_path):
    """scripts/setup.sh in a copy of the checkout, with a PYTHON that records the cache its children see and
    fails, so the script stops before it creates or installs anything."""
    (tmp_path / "scripts").mkdir()
    setup = tmp_path / "scripts" / "setup.sh"
    setup.write_text((REPO / "scripts" / "setup.sh").read_text())
    seen = tmp_path / "seen"
    python = tmp_path / "python"
    python.write_text(f'#!/usr/bin/env bash\necho "${CACHE}" > "{seen}"\nexit 1\n')
    python.chmod(0o755)
    environ = {key: value for key, value in os.environ.items() if key not in (CACHE, old_name(CACHE))}
    done = subprocess.run(["bash", str(setup)], env={**environ, "PYTHON": str(python), old_name(CACHE): "/old/cache"},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and seen.read_text().strip() == "/old/cache"
    [warning] = [line for line in done.stderr.splitlines() if "deprecated" in line]
    assert old_name(CACHE) in warning and f"set {CACHE} instead" in warning
