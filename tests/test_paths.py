"""Files others read are written whole (`write_atomic`); a folder is written by one process at a time
(`folder_lock`): a second `sgl-tts eval --resume` on a folder in use is refused, naming it and the holder."""

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from sgl_tts.paths import LOCK_FILE, FolderLocked, folder_lock, write_atomic

REPO = Path(__file__).resolve().parents[1]


def test_write_atomic_replaces_the_whole_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "summary.json"
    write_atomic(path, "old")
    write_atomic(path, b"new bytes")
    assert path.read_bytes() == b"new bytes" and os.listdir(tmp_path) == ["summary.json"]


def test_a_write_that_fails_before_the_replace_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "experiment.yaml"
    write_atomic(path, "complete: old\n")

    def crash(source, target):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, "complete: new\n")
    assert path.read_text() == "complete: old\n" and os.listdir(tmp_path) == ["experiment.yaml"]


class Holder:
    """Another process holding `folder`'s lock until `release()`."""

    def __init__(self, folder):
        code = ("import sys; from sgl_tts.paths import folder_lock\n"
                f"with folder_lock({str(folder)!r}, 'a test'):\n"
                "    print('held', flush=True); sys.stdin.read()\n")
        self.process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, cwd=REPO)
        assert self.process.stdout.readline().strip() == "held", "the holder did not take the lock"

    def release(self):
        self.process.stdin.close()
        assert self.process.wait(timeout=60) == 0


def test_a_locked_folder_is_refused_naming_it_and_the_holders_pid(tmp_path):
    holder = Holder(tmp_path)
    try:
        with pytest.raises(FolderLocked, match=rf"{tmp_path} is in use by another process \(pid "
                                               rf"{holder.process.pid}, .*{LOCK_FILE}\)"):
            with folder_lock(tmp_path, "a second writer"):
                pass
    finally:
        holder.release()
    with folder_lock(tmp_path, "after the holder") as lock_path:  # released when the holder ended
        assert lock_path.read_text() == str(os.getpid())


def test_waiting_for_a_lock_takes_it_once_released(tmp_path):
    holder = Holder(tmp_path)
    taken = threading.Event()

    def wait_for_it():
        with folder_lock(tmp_path, "waiting", wait=True):
            taken.set()

    waiter = threading.Thread(target=wait_for_it)
    waiter.start()
    assert not taken.wait(timeout=0.5), "taken while another process held it"
    holder.release()
    waiter.join(timeout=60)
    assert taken.is_set()


def test_a_second_eval_resume_on_a_folder_in_use_exits_2_naming_the_folder_and_pid(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "experiment.yaml").write_text(
        "name: locked\nbackend: scripted\nbase:\n  search: {program: best_of_n, max_tokens: 1000}\n"
        "datasets:\n  - name: builtin\narms:\n  - name: best_of_n\n    baseline: true\nn_values: [2]\n")
    (run_dir / "results.jsonl").write_text("")
    holder = Holder(run_dir)
    try:
        refused = subprocess.run([sys.executable, "-m", "sgl_tts.cli", "eval", "--resume", str(run_dir)],
                                 capture_output=True, text=True, cwd=tmp_path, timeout=300)
    finally:
        holder.release()
    assert refused.returncode == 2, refused.stderr
    assert f"sgl-tts: error: {run_dir} is in use by another process (pid {holder.process.pid}" in refused.stderr
    assert sorted(os.listdir(run_dir)) == [LOCK_FILE, "experiment.yaml", "results.jsonl"], "nothing written"
