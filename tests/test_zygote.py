"""The runtime zygote (sgl_tts/runtime/zygote.py): a forked child becomes `python -m MODULE ARGS` with the request's
environment, working directory, output and session; its exit code and its death reach the owner; the thread
count follows the child's environment; a zygote serves only its own import environment and dies with its owner.
Fast: the zygotes here preload nothing or torch alone, and the children run a small module, not SGLang (the
runtime tests start their SGLang servers through the zygote)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sgl_tts import env_names
from sgl_tts.runtime import zygote
from sgl_tts.runtime.server import RuntimeConfig, server_command, server_env, start_server
from sgl_tts.testing import wait_until

# The child's module: reports what it became, then exits with the code it is given, or waits to be killed.
REPORT = textwrap.dedent("""
    import json, os, sys, time
    threads = None
    if "torch" in sys.modules:
        threads = sys.modules["torch"].get_num_threads()
    print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "marker": os.environ.get("ZYGOTE_TEST_MARKER"),
                      "session": os.getsid(0) == os.getpid(), "path0": sys.path[0], "threads": threads,
                      "name": __name__}), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    if sys.argv[1] == "wait":
        time.sleep(600)
    sys.exit(int(sys.argv[1]))
""")


@pytest.fixture
def child_folder(tmp_path):
    (tmp_path / "zygote_report.py").write_text(REPORT)
    return tmp_path


def report(log: Path) -> dict:
    return json.loads(log.read_text().splitlines()[0])


def test_a_child_becomes_the_module_with_the_requests_environment_folder_output_and_session(child_folder,
                                                                                             monkeypatch):
    monkeypatch.chdir(child_folder)
    env = dict(os.environ, ZYGOTE_TEST_MARKER="seen")
    owner_zygote = zygote.Zygote(dict(os.environ), preload=())
    try:
        log = child_folder / "child.log"
        child = owner_zygote.fork([sys.executable, "-m", "zygote_report", "3", "x"], env, log)
        assert child.wait(timeout=120) == 3 == child.returncode
        seen = report(log)
        assert seen["argv"] == ["3", "x"] and seen["name"] == "__main__"
        assert seen["cwd"] == str(child_folder) == seen["path0"]
        assert seen["marker"] == "seen" and seen["session"]
        assert "to stderr" in log.read_text()
        assert child.exit_path.read_text() == "3"
    finally:
        owner_zygote.stop()
    assert not owner_zygote.folder.exists()


@pytest.mark.parametrize("forked", [True, False], ids=["zygote", "direct"])
def test_a_runtimes_environment_imports_its_pythonpath_before_the_working_folder(tmp_path, monkeypatch, forked):
    """`server_env` sets Python's safe path: a module on the runtime's PYTHONPATH wins over one of the same name in
    the working folder (a checkout there, where `python -m` alone would import the working folder's), forked by a
    zygote or started directly; without it the working folder's wins, as `python -m` has it."""
    here, there = tmp_path / "working", tmp_path / "elsewhere"
    for folder in (here, there):
        folder.mkdir()
        (folder / "zygote_report.py").write_text(REPORT.replace('"name": __name__', f'"name": "{folder.name}"'))
    monkeypatch.chdir(here)
    safe = dict(server_env(RuntimeConfig(model="unused", device="cuda")), PYTHONPATH=str(there))
    assert safe[zygote.SAFE_PATH] == "1"
    unsafe = {name: value for name, value in safe.items() if name != zygote.SAFE_PATH}
    for env, expected in ((safe, "elsewhere"), (unsafe, "working")):
        log = tmp_path / f"{expected}.log"
        argv = [sys.executable, "-m", "zygote_report", "0"]
        if forked:
            owner_zygote = zygote.Zygote(env, preload=())
            try:
                assert owner_zygote.fork(argv, env, log).wait(timeout=120) == 0
            finally:
                owner_zygote.stop()
        else:
            with open(log, "w") as output:
                assert subprocess.run(argv, env=env, stdout=output, timeout=120).returncode == 0
        assert report(log)["name"] == expected


def test_a_killed_child_reports_its_signal_and_a_slow_one_times_out(child_folder, monkeypatch):
    monkeypatch.chdir(child_folder)
    owner_zygote = zygote.Zygote(dict(os.environ), preload=())
    try:
        log = child_folder / "waiting.log"
        child = owner_zygote.fork([sys.executable, "-m", "zygote_report", "wait"], dict(os.environ), log)
        wait_until(lambda: log.exists() and "to stderr" in log.read_text(), 120)
        assert child.poll() is None and owner_zygote.busy()
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=0.1)
        os.killpg(child.pid, signal.SIGKILL)  # its own session: its group is its pid
        assert child.wait(timeout=120) == -signal.SIGKILL
        assert not owner_zygote.busy()
    finally:
        owner_zygote.stop()


@pytest.mark.parametrize("threads", ["1", None])
def test_the_childs_torch_threads_follow_its_environment_not_the_zygotes(child_folder, monkeypatch, threads):
    monkeypatch.chdir(child_folder)
    owner_zygote = zygote.Zygote(dict(os.environ, OMP_NUM_THREADS="3"), preload=("torch",))
    try:
        env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
        if threads:
            env["OMP_NUM_THREADS"] = threads
        log = child_folder / "threads.log"
        assert owner_zygote.fork([sys.executable, "-m", "zygote_report", "0"], env, log).wait(timeout=120) == 0
        expected = int(threads) if threads else len(os.sched_getaffinity(0))
        assert report(log)["threads"] == expected != 3
    finally:
        owner_zygote.stop()


def test_a_zygote_serves_only_its_import_environment():
    base = {"PATH": "/bin", "SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "1"}
    assert zygote.import_environment(base) == (("PATH", "/bin"), ("SGLANG_USE_CPU_ENGINE", "1"))
    read_later = dict(base, OMP_NUM_THREADS="2", SGLTTS_CPU_LINEAR="sglang", PYTEST_CURRENT_TEST="t")
    assert zygote.import_environment(read_later) == zygote.import_environment(base)
    for changed in ({"SGLANG_USE_CPU_ENGINE": "0"}, {"LD_LIBRARY_PATH": "/x"}, {"SGLTTS_EVAL_TAG": "t"}):
        assert zygote.import_environment(dict(base, **changed)) != zygote.import_environment(base), changed
    set_by_sglang = dict(base, TRITON_CACHE_DIR="/c/triton", FLASHINFER_WORKSPACE_BASE="/c",
                         **{env_names.PROBE_HEAD: "head.json"})
    assert zygote.import_environment(set_by_sglang) == zygote.import_environment(base)


def test_the_prestarted_zygote_is_the_one_the_cpu_defaults_runtimes_fork_from(monkeypatch):
    """`run`, `serve` and `eval` prestart a zygote before they import SGLang, whose import then sets its cache
    variables in the process's environment, and a session adds the probe head to its generator's: the runtimes of
    the CPU default still have the prestarted zygote's import environment."""
    from sgl_tts.app.session import load_run_config, planned_runtimes

    for name in zygote.SET_BY_SGLANG:
        monkeypatch.delenv(name, raising=False)
    prestarted = zygote.import_environment(server_env(RuntimeConfig()))
    for name in zygote.SET_BY_SGLANG:
        monkeypatch.setenv(name, f"/sglang-cache/{name.lower()}")
    _, runtimes = planned_runtimes(load_run_config("cpu-default"))
    assert runtimes["generator"].env, "the generator's own environment (its probe head) is part of the check"
    for name, config in runtimes.items():
        assert zygote.import_environment(server_env(config)) == prestarted, name


def test_a_prestarted_zygote_is_the_one_a_runtime_then_forks_from(child_folder, monkeypatch):
    monkeypatch.chdir(child_folder)
    monkeypatch.setattr(zygote, "PRELOAD", ())
    zygote.stop_all()
    env = dict(os.environ, ZYGOTE_TEST_MARKER="prestarted")
    try:
        zygote.prestart(env)
        (started,) = zygote._zygotes.values()
        assert started.process.poll() is None
        zygote.prestart(env)  # one per import environment
        assert list(zygote._zygotes.values()) == [started]
        log = child_folder / "child.log"
        child = zygote.fork_runtime([sys.executable, "-m", "zygote_report", "0"], env, log)
        assert child is not None and child.wait(timeout=120) == 0
        assert report(log)["marker"] == "prestarted" and started.ready
        assert zygote.start_for(env) is started
        zygote.prestart(dict(env, **{env_names.RUNTIME_ZYGOTE: zygote.OFF}))  # zygotes switched off: none started
        assert list(zygote._zygotes.values()) == [started]
    finally:
        zygote.stop_all()
    assert zygote._zygotes == {}


def test_a_prestarted_zygote_no_runtime_uses_exits_by_itself_and_a_new_one_serves(child_folder, monkeypatch):
    monkeypatch.chdir(child_folder)
    monkeypatch.setattr(zygote, "PRELOAD", ())
    monkeypatch.setattr(zygote, "PRESTARTED_UNUSED_S", 0.5)
    zygote.stop_all()
    env = dict(os.environ, ZYGOTE_TEST_MARKER="unused")
    try:
        zygote.prestart(env)
        (unused,) = zygote._zygotes.values()
        wait_until(lambda: unused.process.poll() is not None, 120)
        assert unused.process.returncode == 0
        log = child_folder / "child.log"
        child = zygote.fork_runtime([sys.executable, "-m", "zygote_report", "0"], env, log)
        assert child is not None and child.wait(timeout=120) == 0 and report(log)["marker"] == "unused"
        assert zygote.start_for(env) is not unused
    finally:
        zygote.stop_all()


def test_a_zygote_per_import_environment_at_most_max_zygotes_the_idle_replaced(child_folder, monkeypatch):
    monkeypatch.chdir(child_folder)
    monkeypatch.setattr(zygote, "PRELOAD", ())
    zygote.stop_all()
    environments = [dict(os.environ, ZYGOTE_TEST_MARKER=str(k)) for k in range(3)]
    argv = [sys.executable, "-m", "zygote_report", "wait"]

    def fork(k):
        log = child_folder / f"{k}-{len(list(child_folder.glob('*.log')))}.log"
        child = zygote.fork_runtime(argv, environments[k], log)
        if child is not None:
            wait_until(lambda: log.exists() and "to stderr" in log.read_text(), 120)
            assert report(log)["marker"] == str(k)
        return child

    def stop(child):
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(timeout=120)

    try:
        first = fork(0)
        started = zygote.start_for(environments[0])
        second = fork(0)
        assert zygote.start_for(environments[0]) is started and first.pid != second.pid  # one zygote, two forks
        other = fork(1)  # a second import environment: a second zygote
        assert len(zygote._zygotes) == 2 == zygote.MAX_ZYGOTES
        assert fork(2) is None  # both others have runtimes: started afresh
        for child in (first, second):
            stop(child)
        third = fork(2)  # the idle one stopped for it
        assert started.process.poll() is not None and len(zygote._zygotes) == 2
        assert zygote.start_for(environments[1]) is not None
        for child in (other, third):
            stop(child)
    finally:
        zygote.stop_all()
    assert zygote._zygotes == {}


OWNER = """
import os, sys, time
from sgl_tts.runtime.zygote import Zygote
owner_zygote = Zygote(dict(os.environ), preload=())
print(owner_zygote.process.pid, flush=True)
time.sleep(600)
"""


def test_a_zygote_dies_with_its_owner():
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[1])
    try:
        pid = int(owner.stdout.readline())
        assert Path(f"/proc/{pid}").exists()
        owner.kill()
        owner.wait()
        wait_until(lambda: not Path(f"/proc/{pid}").exists(), 60)  # reaped by init once it exits
    finally:
        owner.kill()
        owner.stdout.close()


def test_cpu_launches_are_forked_unless_switched_off(tmp_path, monkeypatch):
    """start_server's choice, with the zygote's fork replaced by a recorder (no SGLang started)."""
    forked = []
    monkeypatch.setattr(zygote, "fork_runtime", lambda argv, env, log: forked.append(argv) or "forked")
    monkeypatch.setattr("sgl_tts.runtime.server.spawn_group", lambda cmd, log, env: "spawned")
    cpu, cuda = RuntimeConfig(device="cpu"), RuntimeConfig(device="cuda")
    launch = server_command(cpu, "/m", 1)
    assert start_server(cpu, launch, tmp_path / "a.log") == "forked" and forked == [launch]
    assert start_server(cuda, server_command(cuda, "/m", 1), tmp_path / "b.log") == "spawned"
    assert start_server(cpu, [sys.executable, "-c", "pass"], tmp_path / "c.log") == "spawned"
    off = RuntimeConfig(device="cpu", env={"SGLTTS_RUNTIME_ZYGOTE": zygote.OFF})
    assert zygote.enabled(server_env(off)) is False
    assert start_server(off, server_command(off, "/m", 1), tmp_path / "d.log") == "spawned" and len(forked) == 1


def test_a_zygote_that_cannot_fork_is_dropped_and_one_a_parent_owned_is_left_alone(child_folder, monkeypatch):
    monkeypatch.chdir(child_folder)
    monkeypatch.setattr(zygote, "PRELOAD", ())
    zygote.stop_all()
    env = dict(os.environ)
    inherited = None
    try:
        broken = zygote.start_for(env)
        broken.socket_path.unlink()  # its socket gone: the fork's connect fails
        assert zygote.fork_runtime([sys.executable, "-m", "zygote_report", "0"], env, child_folder / "a.log") is None
        assert broken.process.poll() is not None and zygote._zygotes == {}
        inherited = zygote.start_for(env)
        inherited.owner = -1  # as in a forked child of the owner: not this process's to use or stop
        mine = zygote.start_for(env)
        assert mine is not inherited and inherited.process.poll() is None
        zygote.stop_all()
        assert mine.process.poll() is not None and inherited.process.poll() is None
    finally:
        zygote.stop_all()
        if inherited is not None:
            inherited.stop()


REAPER = """
import os, sys
from pathlib import Path
from sgl_tts.runtime import zygote
folder = Path(sys.argv[1])
children = {}
for code in (7, -9):
    pid = os.fork()
    if pid == 0:
        if code < 0:
            os.kill(os.getpid(), -code)
        os._exit(code)
    children[pid] = code
seen, replace = [], os.replace
def replaced(staged, path):
    seen.append(all(Path(f"/proc/{pid}").exists() for pid in children if Path(path).name == f"{pid}.exit"))
    replace(staged, path)
os.replace = replaced
exits = {pid: str(folder / f"{pid}.exit") for pid in children}
while exits:
    zygote.reap(exits)
codes = {code: int((folder / f"{pid}.exit").read_text()) for pid, code in children.items()}
print(seen, codes == {7: 7, -9: -9}, any(Path(f"/proc/{pid}").exists() for pid in children))
"""


def test_an_exit_code_is_written_while_its_process_is_still_in_proc(tmp_path):
    """The owner reads a process gone from /proc without an exit file as orphaned (UNKNOWN_EXIT), so the zygote
    writes the code before it reaps the child (run in a process of its own: `reap` collects any child)."""
    out = subprocess.run([sys.executable, "-c", REAPER, str(tmp_path)], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.split("\n")[0] == "[True, True] True False", out.stderr
