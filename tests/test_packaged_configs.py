"""Run configs ship inside the package: `sgl-tts run` finds its default, and configs by name, from any directory."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sgl_tts.app.session import RUN_CONFIGS, RunConfig, load_run_config
from sgl_tts.config import ConfigError, load_yaml

SOURCE_CONFIGS = Path(__file__).resolve().parents[1] / "sgl_tts" / "configs"

REPO = Path(__file__).resolve().parents[1]


def test_packaged_configs_are_found_by_name_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert RUN_CONFIGS == REPO / "sgl_tts" / "configs"
    default = load_yaml(RunConfig, REPO / "sgl_tts" / "configs" / "cpu-default.yaml")
    for name in ("cpu-default", "cpu-default.yaml", "configs/cpu-default.yaml"):
        assert load_run_config(name) == default, name
    assert load_run_config("rsd-cpu").search.program == "rsd"


def test_a_file_that_exists_wins_over_a_packaged_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cpu-default.yaml").write_text("search:\n  n: 7\n")
    assert load_run_config("cpu-default.yaml").search.n == 7
    assert load_run_config("cpu-default").search.n == 16, "no file 'cpu-default' here: the packaged one"


def test_an_unknown_config_lists_the_packaged_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    packaged = ", ".join(sorted(p.stem for p in SOURCE_CONFIGS.glob("*.yaml")))
    with pytest.raises(ConfigError, match=r"config file not found: configs/gpu\.yaml \(and no packaged config "
                                          rf"named 'gpu'; packaged: {packaged}\)"):
        load_run_config("configs/gpu.yaml")
    absolute = tmp_path / "cpu-default.yaml"  # an absolute path is taken as given
    with pytest.raises(ConfigError, match=rf"^config file not found: {absolute}$"):
        load_run_config(absolute)


def _run_cli(args, cwd, **env):
    import os

    return subprocess.run([sys.executable, "-m", "sgl_tts.cli", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)


def test_the_cli_finds_its_default_config_outside_the_checkout(tmp_path):
    # `--program rsd` on the default config is refused before any runtime starts (it has no target): an error
    # that proves the default config was found and read.
    proc = _run_cli(["run", "--program", "rsd"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "needs 'target'" in proc.stderr and "not found" not in proc.stderr


def test_the_configs_ship_in_the_wheel_and_work_installed(tmp_path):
    """Build the wheel offline, install it into a bare folder and run the command from elsewhere."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for package in ("sgl_tts", "policies", "programs", "eval"):
        shutil.copytree(REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(source)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("sgl_tts-*.whl")
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    assert sorted(p.name for p in (site / "sgl_tts" / "configs").glob("*.yaml")) == \
        sorted(p.name for p in SOURCE_CONFIGS.glob("*.yaml"))
    assert (site / "policies" / "paged_attention.cpp").is_file(), "the attention kernel's source, built on first use"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run([sys.executable, "-c", "import sgl_tts; print(sgl_tts.__file__)"], cwd=elsewhere,
                           capture_output=True, text=True, env={"PYTHONPATH": str(site)}, check=True)
    assert Path(where.stdout.strip()).is_relative_to(site), "the installed copy must be the one imported"
    proc = _run_cli(["run", "--program", "rsd"], cwd=elsewhere, PYTHONPATH=str(site))
    assert proc.returncode == 2 and "needs 'target'" in proc.stderr, proc.stderr


def test_every_packaged_config_loads_and_each_gpu_verifier_config_is_complete():
    from sgl_tts.scoring.prm import classifier_runtime_config

    configs = {path.stem: load_run_config(path.stem) for path in SOURCE_CONFIGS.glob("*.yaml")}
    gpu = {name: config for name, config in configs.items() if name.startswith("gpu-")}
    assert {c.scorer.kind for c in gpu.values()} == {"math_shepherd", "rlhflow", "classifier", "skywork"}
    for name, config in gpu.items():
        assert config.generator.device == config.scorer.runtime.device == "cuda", name
    for name in ("gpu-qwen-prm", "gpu-skywork-prm"):  # our model classes, served in generation mode
        runtime = gpu[name].scorer.runtime
        cached = classifier_runtime_config(runtime.model, cached=True)
        assert (runtime.env, runtime.is_embedding, runtime.extra_args) == (cached.env, False, cached.extra_args)
