"""The set-up gives each checkout an environment of its own code over the shared packages."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from sgl_tts import env_names

REPO = Path(__file__).resolve().parents[1]


def test_the_environment_imports_this_checkout_from_anywhere(tmp_path):
    """Subprocesses (the `sgl-tts` script, SGLang's scheduler loading the policy plugin) import the installed
    sgl_tts, not the current folder's: a cached environment must point at this checkout."""
    found = subprocess.run([sys.executable, "-c", "import sgl_tts, policies; print(sgl_tts.__file__); "
                            "print(policies.__file__)"], cwd=tmp_path, capture_output=True, text=True, check=True)
    paths = [Path(line).resolve() for line in found.stdout.split()]
    assert [p.parent.parent for p in paths] == [REPO, REPO], f"run `make setup` here; found {paths}"


def test_the_installed_console_script_is_the_one_pyproject_names():
    """The set-up installs the checkout again when pyproject.toml changes, so a moved entry point (`sgl-tts`)
    does not leave a stale script behind."""
    import tomllib
    from importlib.metadata import entry_points

    wanted = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    installed = {entry.name: entry.value for entry in entry_points(group="console_scripts") if entry.name in wanted}
    assert installed == wanted, "run `make setup` here"


# ---- scripts/setup.sh cannot lie: run in a copy of the checkout, on a temporary cache, with a fake venv ----

PIP_ERROR = "ERROR: Could not find a version that satisfies the requirement sglang==0.5.23 (fake pip)"


def fake_setup(tmp_path, pip_status, venv_python, pyproject=None):
    """A copy of scripts/setup.sh and pyproject.toml, a temporary SGLTTS_CACHE, `pip` on PATH answering with
    `pip_status` (pip's error on failure, the harmless `WARNING: Location` line always), and a PYTHON whose
    `-m venv` makes an environment of that pip and `venv_python`: nothing real is installed or touched."""
    checkout, bin_dir, cache = tmp_path / "checkout", tmp_path / "bin", tmp_path / "cache"
    (checkout / "scripts").mkdir(parents=True)
    bin_dir.mkdir()
    shutil.copy(REPO / "scripts/setup.sh", checkout / "scripts/setup.sh")
    (checkout / "pyproject.toml").write_text(pyproject or (REPO / "pyproject.toml").read_text())
    shutil.copy(REPO / "constraints.txt", checkout / "constraints.txt")
    error = f'echo "{PIP_ERROR}" >&2; ' if pip_status else ""
    executable(bin_dir / "pip", f'echo "WARNING: Location is not writable (harmless)" >&2; echo "pip $*" >> '
                                f'"{tmp_path}/pip.log"; {error}exit {pip_status}')
    executable(bin_dir / "python", f'if [ "$1" = -m ] && [ "$2" = venv ]; then mkdir -p "$3/bin"; '
                                   f'ln -s "$(command -v pip)" "$3/bin/pip"; ln -s "{venv_python}" "$3/bin/python"; '
                                   f'exit 0; fi\nexec "{sys.executable}" "$@"')
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": str(bin_dir / "python"),
           "SGLTTS_CACHE": str(cache), "HOME": str(tmp_path)}
    done = subprocess.run(["bash", str(checkout / "scripts/setup.sh")], env=env, capture_output=True, text=True,
                          timeout=120)
    return done, checkout, cache


def executable(path, body):
    path.write_text("#!/usr/bin/env bash\n" + body + "\n")
    path.chmod(0o755)


def complete_marks(cache):
    return list(cache.glob("venv-*/.sgl-tts-complete"))


def test_a_failing_pip_stops_set_up_with_pips_message_and_no_complete_mark(tmp_path):
    done, checkout, cache = fake_setup(tmp_path, pip_status=1, venv_python=sys.executable)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert PIP_ERROR in output and "'pip install --upgrade pip' failed" in output, output
    assert "WARNING: Location" not in output, "the known harmless line is filtered"
    assert (tmp_path / "pip.log").read_text().splitlines() == ["pip install -q --upgrade pip"], "stopped there"
    assert complete_marks(cache) == [] and not (checkout / ".venv").exists()


def test_set_up_is_marked_complete_only_when_every_declared_package_imports(tmp_path):
    bare = tmp_path / "bare-python"  # the system's Python without site-packages: no declared package imports
    executable(bare, f'exec "{sys.base_prefix}/bin/python3" -S "$@"')
    done, checkout, cache = fake_setup(tmp_path, pip_status=0, venv_python=bare)
    assert done.returncode != 0, done.stdout + done.stderr
    assert "pip install -q -c constraints.txt -r " in (tmp_path / "pip.log").read_text()
    installed = next(cache.glob("venv-*/.sgl-tts-requirements.txt")).read_text().split()
    assert {"pytest", "nbclient"} <= set(installed), "the test extra is installed"
    assert not any(line.startswith("sgl-tts") or line.startswith("-e") for line in installed), "not the project"
    message = next(line for line in done.stderr.splitlines() if "do not import" in line)
    missing = [item.split(" (")[0] for item in message.split("do not import: ", 1)[1].split("; ")]
    declared = {"sglang", "torch", "yaml", "math_verify", "sglang_router", "pytest", "nbclient", "setuptools"}
    assert declared <= set(missing)
    for name in missing:  # the names are import names: each imports in this (complete) environment
        __import__(name)
    assert complete_marks(cache) == [] and not (checkout / ".venv").exists()


def test_the_python_floor_matches_the_code():
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.11", "tomllib (setup.sh, tests) is Python 3.11+"
    assert "pytest" in project["optional-dependencies"]["test"] and not any(
        d.startswith(("pytest", "nbclient", "nbformat", "ipykernel")) for d in project["dependencies"])


def test_the_environment_is_installed_at_the_committed_versions():
    pins = [line for line in (REPO / "constraints.txt").read_text().splitlines() if line and not line.startswith("#")]
    assert all("==" in line for line in pins), "every constraint is an exact version"
    names = {line.split("==")[0].lower() for line in pins}
    for pinned in ("sglang", "torch", "transformers", "sglang-router", "pytest"):
        assert pinned in names, f"{pinned} has a pinned version"
    assert "-c constraints.txt" in (REPO / "scripts/setup.sh").read_text(), "set-up installs under the constraints"


# ---- two checkouts share the heavy environment, each runs its own code ----

PROBE = """
import importlib, importlib.metadata as metadata, json, sgl_tts
plugins = [entry for entry in metadata.entry_points(group="sglang.srt.plugins") if entry.name == "sgl_tts_policies"]
print(json.dumps({"checkout": sgl_tts.CHECKOUT, "sgl_tts": sgl_tts.__file__,
                  "plugins": [importlib.import_module(entry.module).__file__ for entry in plugins]}))
"""


def clone_of_this_tree(destination, name):
    """`git clone` of this repository with the working tree's changes laid over it (the set-up under test may be
    uncommitted), its sgl_tts marked with `name`: CHECKOUT, and printing it on import when asked."""
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(destination)], check=True)
    git = ["git", "-C", str(REPO)]
    changed = subprocess.run(git + ["diff", "--name-only", "HEAD"], capture_output=True, text=True, check=True).stdout
    new = subprocess.run(git + ["ls-files", "--others", "--exclude-standard"], capture_output=True, text=True,
                         check=True).stdout
    for path in (changed + new).split():
        if (REPO / path).exists():
            (destination / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO / path, destination / path)
        else:
            (destination / path).unlink(missing_ok=True)
    init = destination / "sgl_tts/__init__.py"
    init.write_text(init.read_text() + f"\nCHECKOUT = {name!r}\nimport os as _os\n"
                    f"if _os.environ.get('SAY_CHECKOUT'):\n    print('checkout', CHECKOUT)\n")
    return destination


def test_two_checkouts_sharing_the_environment_each_run_their_own_code(tmp_path):
    """The heavy environment is shared by every checkout of one dependency spec; each checkout's own .venv holds
    only its editable install. Set up A, then B: A's `sgl-tts`, its `sgl_tts` and its scheduler plugin (the
    `sglang.srt.plugins` entry point SGLang's scheduler loads) are still A's. Against a stand-in for this
    machine's shared environment (a light environment that sees the real one's packages), so nothing real is
    changed; it starts as an older set-up left it: holding B's editable install, A's `.venv` a link to it."""
    from importlib.util import find_spec

    real = Path(find_spec("sglang").origin).parents[4]  # .../venv-<key>/lib/python3.X/site-packages/sglang
    assert real.name.startswith("venv-") and (real / ".sgl-tts-complete").exists(), "run `make setup` here"
    shared = tmp_path / "cache" / real.name  # the same key: this tree's dependency spec is the one set up
    subprocess.run([real / "bin/python", "-m", "venv", "--without-pip", shared], check=True)
    site_packages = lambda env: next(env.glob("lib/python3*/site-packages"))  # noqa: E731
    (site_packages(shared) / "real.pth").write_text(f"import site; site.addsitedir({str(site_packages(real))!r})\n")
    executable(shared / "bin/pip", f'exec "{shared}/bin/python" -m pip "$@"')
    (shared / ".sgl-tts-complete").touch()

    a, b = clone_of_this_tree(tmp_path / "A", "A"), clone_of_this_tree(tmp_path / "B", "B")
    subprocess.run([shared / "bin/pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", b],
                   check=True, capture_output=True)
    (a / ".venv").symlink_to(shared)

    env = {**os.environ, env_names.CACHE: str(tmp_path / "cache")}
    env.pop(env_names.old_name(env_names.CACHE), None)

    def set_up(checkout):
        done = subprocess.run(["bash", checkout / "scripts/setup.sh", "--checkout-only"], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    set_up(a)
    set_up(b)  # B set up last
    for checkout in (a, b):
        venv = checkout / ".venv"
        found = subprocess.run([venv / "bin/python", "-c", PROBE], cwd=tmp_path, capture_output=True, text=True)
        assert found.returncode == 0, found.stderr
        probe = json.loads(found.stdout)
        assert probe["checkout"] == checkout.name and Path(probe["sgl_tts"]).is_relative_to(checkout), probe
        assert probe["plugins"] == [str(checkout / "policies/plugin.py")], probe
        script = subprocess.run([venv / "bin/sgl-tts", "--version"], cwd=tmp_path, env={**env, "SAY_CHECKOUT": "1"},
                                capture_output=True, text=True)
        assert script.returncode == 0 and script.stdout.startswith(f"checkout {checkout.name}\n"), script
        assert venv.is_dir() and not venv.is_symlink(), "the older set-up's link is replaced by the checkout's own"
    assert (shared / ".sgl-tts-complete").exists(), "the shared environment is not removed through A's old link"
    assert not list(site_packages(shared).glob("sgl_tts-*.dist-info")), "the older set-up's install is removed"
    assert "installing" not in set_up(a), "set up again: nothing to install"


def test_only_the_test_extra_keys_the_shared_environment(tmp_path):
    """An extra installed into a checkout's .venv alone (`peers`, by --peers) must not change the shared
    environment's key (a new key is an 11 GB rebuild); a change of the test extra, which it installs, must."""
    import tomllib

    bare = tmp_path / "bare-python"  # stops set-up at the completeness check, after the key named the venv
    executable(bare, f'exec "{sys.base_prefix}/bin/python3" -S "$@"')

    def key_with(pyproject_text, name):
        (tmp_path / name).mkdir()
        fake_setup(tmp_path / name, pip_status=0, venv_python=bare, pyproject=pyproject_text)
        return [path.name for path in (tmp_path / name / "cache").glob("venv-*")]

    text = (REPO / "pyproject.toml").read_text()
    assert "peers" in tomllib.loads(text)["project"]["optional-dependencies"]
    base = key_with(text, "base")
    other_extra = text.replace('peers = [', 'another = ["numpy"]\npeers = [')
    test_extra = text.replace('test = ["pytest"', 'test = ["pytest-timeout", "pytest"')
    assert tomllib.loads(other_extra)["project"]["optional-dependencies"]["another"] == ["numpy"]
    assert len(base) == 1 and key_with(other_extra, "other") == base
    assert key_with(test_extra, "test") != base
    shared = REPO / ".venv/.sgl-tts-shared"  # the shared environment this checkout was set up on
    if shared.exists():
        assert base == [Path(shared.read_text().strip()).name], "this tree's spec keys the environment set up"
