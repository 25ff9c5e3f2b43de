import shutil
import subprocess
import sys

import pytest


def nbtrain(*args, timeout=180):
    exe = shutil.which("nbtrain") or sys.executable
    cmd = [exe, *args] if exe.endswith("nbtrain") else [exe, "-m", "nbtrain.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["auto", "ddp_spawn"])
def test_demo_trains_on_two_cpu_ranks(strategy):
    run = nbtrain("demo", "--accelerator", "cpu", "--epochs", "2", "--strategy", strategy)
    assert run.returncode == 0, run.stderr
    assert "rank 0: final loss" in run.stdout and "rank 1: final loss" in run.stdout
    assert "effective batch size: 128" in run.stdout
    losses = [float(line.split()[-1]) for line in run.stdout.splitlines() if "final loss" in line]
    assert all(loss < 0.5 for loss in losses)  # it learned: chance level is ~0.69


def test_demo_bad_input_is_one_line():
    run = nbtrain("demo", "--strategy", "warp")
    assert run.returncode == 2
    assert "nbtrain demo: strategy='warp' is not known. Accepted:" in run.stderr
    assert "Traceback" not in run.stderr
