"""The set-up points the environment at the checkout under test."""

import subprocess
import sys
from pathlib import Path

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
