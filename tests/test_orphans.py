"""No server outlives its owner: a SIGKILL of the owner's whole process group (the watchdog's owner, not the
watchdog) still stops the server's group. Fast: the "server" is a sleeping Python process started the way
servers are started (`spawn_group`), watched by the same `Runtime` code."""

import os
import signal
import subprocess
import sys
from pathlib import Path

from sgl_tts.runtime.server import group_members
from sgl_tts.testing import wait_until

# The owner: starts a stand-in server like Runtime.start does, wraps it in a Runtime (which starts the watchdog),
# prints the server's pid (its group id) and the watchdog's pid, then sleeps until it is killed.
OWNER = """
import sys, time
from pathlib import Path
from sgl_tts.runtime.server import Runtime, RuntimeConfig, spawn_group
log = Path(sys.argv[1]) / "stand-in.log"
server = spawn_group([sys.executable, "-c", "import time; time.sleep(600)"], log)
runtime = Runtime("stand-in", RuntimeConfig(), "none", 1, server, log)
print(server.pid, runtime.watchdog.pid, flush=True)
time.sleep(600)
"""


def test_a_sigkill_of_the_owners_whole_group_leaves_no_server(tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                             start_new_session=True, cwd=Path(__file__).resolve().parents[1])
    server = None
    try:
        server, watchdog = map(int, owner.stdout.readline().split())
        assert group_members(server) == [server], "the stand-in runs in a group of its own"
        assert os.getpgid(watchdog) not in (owner.pid, server), "the watchdog is outside the owner's group"
        os.killpg(owner.pid, signal.SIGKILL)  # the owner's whole group, as a terminal's kill or an OOM group kill
        owner.wait()
        wait_until(lambda: not group_members(server))
        wait_until(lambda: not _exists(watchdog))  # its work done, the watchdog exits too
    finally:
        if owner.poll() is None:
            os.killpg(owner.pid, signal.SIGKILL)
            owner.wait()
        if server is not None and group_members(server):
            os.killpg(server, signal.SIGKILL)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False
