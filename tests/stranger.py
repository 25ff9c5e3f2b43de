"""A second local account, for tests of what another user of the machine can reach.

`stranger` (a fixture: import it into a test module) creates the account with `useradd` and
removes it after the test; `Stranger.python(code)` runs Python as that account (this
interpreter's packages and nbtrain on its path, nothing of ours in its environment). Where the
tests do not run as root, no account can be made: the test is skipped, saying so.
"""
from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

REPOSITORY = str(Path(__file__).resolve().parent.parent)
PYTHON = "/usr/bin/python3"  # the venv's interpreter lives in root's home, which others cannot enter


class Stranger:
    """The account, by name; it pickles, so a rank (root too) can run code as the stranger."""

    def __init__(self, name: str):
        self.name = name
        self.path = os.pathsep.join([*site.getsitepackages(), REPOSITORY])

    def python(self, code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(["runuser", "-u", self.name, "--", "env", "-i", f"PYTHONPATH={self.path}", "HOME=/tmp",
                               PYTHON, "-c", code, *args], capture_output=True, text=True, timeout=timeout)

    def json(self, code: str, *args: str, timeout: float = 60):
        """What `code` printed last, as JSON (it prints one JSON line at the end)."""
        done = self.python(code, *args, timeout=timeout)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def stranger():
    if os.geteuid() != 0:
        pytest.skip("a second local account is needed, and only root can create one (useradd): not root here")
    missing = [tool for tool in ("useradd", "userdel", "runuser") if shutil.which(tool) is None]
    if missing or not os.access(PYTHON, os.X_OK):
        pytest.skip(f"a second local account is needed: {', '.join(missing) or PYTHON} not found here")
    if f"{sys.version_info.major}.{sys.version_info.minor}" not in os.path.realpath(PYTHON):
        pytest.skip(f"{PYTHON} is not Python {sys.version_info.major}.{sys.version_info.minor}, the packages' version")
    name = f"nbtrain-s{os.getpid()}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True,
                   capture_output=True)
    try:
        yield Stranger(name)
    finally:
        subprocess.run(["userdel", name], capture_output=True)
