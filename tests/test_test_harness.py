"""The suite's own hygiene: what a test starts in a session of its own does not outlive a test
process that is killed before its teardown."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from conftest import ROOT, wait_until

CHILD = """
import subprocess, sys, time
sys.path.insert(0, "tests")
from conftest import reap_with_this_process
server = reap_with_this_process(subprocess.Popen(
    [sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True))
print(server.pid, flush=True)
time.sleep(300)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead too
        return f.read().split(") ", 1)[1][0] != "Z"


def test_a_killed_test_process_takes_its_servers_with_it():
    test = subprocess.Popen([sys.executable, "-c", CHILD], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    server = int(test.stdout.readline())
    assert _alive(server)
    test.send_signal(signal.SIGKILL)  # no teardown, no atexit
    test.wait()
    start = time.monotonic()
    wait_until(lambda: not _alive(server), 20, "the watchdog to kill the server")
    assert time.monotonic() - start < 20
