import shutil
import subprocess
import sys
import time
from importlib.metadata import version

import pytest

import nbtrain
from nbtrain.cli import main


def nbtrain_cli(*args, timeout=180):
    """The installed `nbtrain` command in a process of its own, as a user runs it."""
    exe = shutil.which("nbtrain") or sys.executable
    cmd = [exe, *args] if exe.endswith("nbtrain") else [exe, "-m", "nbtrain.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def run_main(capsys, *args):
    """`main` in this process: (exit status, stdout, stderr), argparse's own exits included."""
    try:
        code = main(list(args))
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow
@pytest.mark.parametrize("how", [(), ("--start", "template")])  # ddp_spawn, the earlier name: test_choices.py
def test_demo_trains_on_two_cpu_ranks(how):
    run = nbtrain_cli("demo", "--accelerator", "cpu", "--epochs", "2", *how)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    own = {int(line.split()[1].rstrip(":")): float(line.split()[5]) for line in lines
           if line.startswith("rank ") and "last batch loss" in line and "(this rank's own batch)" in line}
    assert sorted(own) == [0, 1]
    assert all(loss < 0.5 for loss in own.values())  # it learned: chance level is ~0.69
    # The live metric is the mean over ranks, and the demo labels it as that.
    mean = [line for line in lines if line.startswith("mean over ranks: ")]
    assert len(mean) == 1 and "the mean_loss= in the table above" in mean[0]
    table = [line for line in lines if line.startswith("  rank ") and "mean_loss=" in line]
    assert len(table) == 2  # what that line points at is there, even for a run too short for live lines
    assert float(mean[0].split()[3]) == pytest.approx(sum(own.values()) / 2, abs=2e-4)
    assert "effective batch size: 128" in run.stdout
    if not how:  # start='auto' says its choice on one line, and the summary at the end
        said = [line for line in lines if line.startswith("nbtrain: ddp on 2 CPU ranks, gloo")]
        assert said[0] == "nbtrain: ddp on 2 CPU ranks, gloo (started by fork, chosen by start='auto')"
        assert said[1].startswith("nbtrain: ddp on 2 CPU ranks, gloo: finished in ")
        assert len(said) == 2


def in_a_terminal(args: list[str], columns: int = 120, timeout: float = 240) -> bytes:
    """What `args` writes to a real terminal (a pty of `columns`), every byte."""
    import fcntl
    import os
    import pty
    import select
    import struct
    import termios

    ours, theirs = pty.openpty()
    fcntl.ioctl(theirs, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    proc = subprocess.Popen(args, stdin=theirs, stdout=theirs, stderr=theirs, close_fds=True)
    os.close(theirs)
    out, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([ours], [], [], 0.5)[0]:
                try:
                    chunk = os.read(ours, 65536)
                except OSError:  # EIO: the command ended and closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
    finally:
        proc.kill()
        proc.wait()
        os.close(ours)
    return out


def column_of(screen: bytes, text: bytes) -> int:
    """The column a terminal starts `text`'s last occurrence at: the bytes before it played as a
    terminal moves its cursor (CR, LF, CSI sequences, one column per character)."""
    column, at, end = 0, 0, screen.rindex(text)
    while at < end:
        byte = screen[at]
        if byte in b"\r\n":
            column = 0
        elif screen.startswith(b"\x1b[", at):  # cursor up/down, erase: the column stays
            at += 2
            while at < end and not 0x40 <= screen[at] <= 0x7E:
                at += 1
        elif byte >= 0x20 and not 0x80 <= byte < 0xC0:  # a character (a UTF-8 lead byte counts once)
            column += 1
        at += 1
    return column


@pytest.mark.slow
def test_demo_in_a_terminal_writes_its_summary_from_the_first_column():
    screen = in_a_terminal([sys.executable, "-m", "nbtrain", "demo", "--accelerator", "cpu", "--epochs", "2"])
    assert b"nbtrain: ddp on 2 CPU ranks, gloo: finished in " in screen, screen[-2000:]
    assert b"\x1b[A" in screen  # tqdm's bars were drawn, one per rank, and moved the cursor
    assert column_of(screen, b"nbtrain: ddp on 2 CPU ranks, gloo: finished in ") == 0, screen[-600:]


@pytest.mark.slow
def test_the_installed_command_reports_its_version():
    run = nbtrain_cli("--version", timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"nbtrain {version('nbtrain')}"


@pytest.mark.slow
def test_the_version_and_help_do_not_import_torch():
    # `nbtrain --version` took ~5 s: the package imported torch. Its public names now load on use.
    code = ("import sys, nbtrain.cli\n"
            "try:\n    nbtrain.cli.main(['--version'])\nexcept SystemExit: pass\n"
            "print('torch' in sys.modules, 'launch' in dir(nbtrain))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.stdout.splitlines()[-1] == "False True", run.stdout + run.stderr


def test_version_is_the_installed_metadata_and_the_same_everywhere(capsys):
    assert nbtrain.__version__ == version("nbtrain") != "0+unknown"
    code, out, _ = run_main(capsys, "--version")
    assert code == 0 and out.strip() == f"nbtrain {nbtrain.__version__}"


def test_bare_command_prints_help(capsys):
    code, out, err = run_main(capsys)
    assert code == 0 and err == ""
    assert out.startswith("usage: nbtrain")
    assert "demo" in out and "gpus" in out and "--version" in out
    assert "required" not in out


def test_unknown_command_is_a_usage_error(capsys):
    code, _, err = run_main(capsys, "train")
    assert code == 2
    assert "invalid choice: 'train'" in err


def test_demo_bad_input_is_one_line(capsys):
    code, out, err = run_main(capsys, "demo", "--strategy", "warp")
    assert code == 2 and out == ""
    assert err.startswith("nbtrain demo: strategy='warp' is not known. Accepted:")
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.slow
def test_ctrl_c_during_the_first_use_waits_for_torchs_import():
    # `import nbtrain` is light; the first nbtrain.launch imports torch. A Ctrl-C half-way
    # through that import left a torch that could never be imported again in the kernel.
    code = ("import os, signal, sys, threading, time, nbtrain\n"
            "threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()\n"
            "try:\n    nbtrain.launch\nexcept KeyboardInterrupt:\n    print('interrupted after the import')\n"
            "import torch\nprint(float(torch.ones(2).sum()), 'launch' in vars(nbtrain))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.stdout.splitlines() == ["interrupted after the import", "2.0 True"], run.stdout + run.stderr


def test_short_version_flag(capsys):
    code, out, _ = run_main(capsys, "-V")
    assert code == 0 and out.strip() == f"nbtrain {nbtrain.__version__}"


def test_runs_of_a_folder_without_runs_says_so(capsys, tmp_path):
    code, out, err = run_main(capsys, "runs", str(tmp_path))
    assert (code, out, err) == (0, f"no runs under {tmp_path}\n", "")


def test_runs_of_a_folder_that_does_not_exist_fails_saying_so(capsys, tmp_path):
    code, out, err = run_main(capsys, "runs", str(tmp_path / "nope"))
    assert (code, out) == (2, "")
    assert err == (f"nbtrain runs: '{tmp_path / 'nope'}' does not exist: give the folder that holds run directories "
                   "(by default nbtrain-runs, where nbtrain.submit puts them)\n")


def test_runs_of_a_run_directory_points_at_attach(capsys, tmp_path):
    (tmp_path / "run.json").write_text("{}")
    code, out, err = run_main(capsys, "runs", str(tmp_path))
    assert (code, out) == (2, "")
    assert err.startswith(f"nbtrain runs: runs(path='{tmp_path}'): it is a run directory itself: see it with "
                          f"nbtrain.attach('{tmp_path}') (in a shell: nbtrain attach {tmp_path})")


def test_attach_to_what_is_not_a_run_is_one_line(capsys, tmp_path):
    code, out, err = run_main(capsys, "attach", str(tmp_path))
    assert code == 2 and out == ""
    assert err.startswith(f"nbtrain attach: '{tmp_path}' is not a run directory (no run.json, status.json)")
    assert err.count("\n") == 1
    code, _, err = run_main(capsys, "attach", str(tmp_path), "--lines", "-3")
    assert code == 2 and "argument --lines: -3: give a number of lines, 0 or more" in err
    code, _, err = run_main(capsys, "attach", str(tmp_path), "--lines", "ten")
    assert code == 2 and "argument --lines: ten: give a number of lines, 0 or more" in err


def _says_hello(n):
    ctx = nbtrain.context()
    for step in range(3):
        print(f"hello {step} from rank {ctx.rank}")
        ctx.log("loss", 1.0 / (step + 1))
    return n * n


def _fails(n):
    raise ValueError(f"bad batch {n}")


@pytest.mark.slow
def test_runs_and_attach_in_a_shell(tmp_path, no_leftovers):
    good = nbtrain.submit(_says_hello, 7, devices=2, accelerator="cpu", run_dir=tmp_path / "runs" / "good")
    bad = nbtrain.submit(_fails, 3, devices=1, accelerator="cpu", run_dir=tmp_path / "runs" / "bad")
    assert good.wait(timeout=180) == "finished" and bad.wait(timeout=180) == "failed"

    listing = nbtrain_cli("runs", str(tmp_path / "runs"))
    assert listing.returncode == 0, listing.stderr
    header, *rows = listing.stdout.splitlines()
    assert header.split() == ["run", "function", "started", "devices", "status", "metrics"]
    assert sorted(row.split()[1] for row in rows) == ["_fails", "_says_hello"]
    assert all(f" {status} " in f"{row} " for row, status in zip(sorted(rows), ("failed", "finished")))
    assert listing.stdout.strip() == repr(nbtrain.runs(tmp_path / "runs")).strip()
    # The listing reads each run's files, never its pickles: no torch (its import was ~2.5 s of CPU a listing).
    code = f"import sys, nbtrain.cli\nnbtrain.cli.main(['runs', {str(tmp_path / 'runs')!r}])\nprint('torch' in sys.modules)"
    light = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert light.stdout.splitlines()[-1] == "False", light.stdout + light.stderr

    shown = nbtrain_cli("attach", str(good.dir), "--lines", "2")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines() == [
        "_says_hello: finished", "--- rank 0, last 2 lines ---", "hello 1 from rank 0", "hello 2 from rank 0",
        "--- result ---", repr(good.result(timeout=1))]

    failed = nbtrain_cli("attach", str(bad.dir))
    assert failed.returncode == 1, failed.stderr
    assert failed.stdout.startswith("_fails: failed")
    assert "--- error ---" in failed.stdout and "ValueError: bad batch 3" in failed.stdout


def _peak_of(call) -> int:
    """The most memory Python allocated while `call` ran (tracemalloc), in bytes."""
    import tracemalloc

    tracemalloc.start()
    try:
        call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


LOG_BYTES = 64 << 20


@pytest.mark.slow
def test_attach_reads_a_huge_log_from_its_end_and_a_damaged_summary_hides_nothing(tmp_path, capsys, no_leftovers):
    from nbtrain.common import protocol, runlog

    run = nbtrain.submit(_says_hello, 7, devices=2, accelerator="cpu", run_dir=tmp_path / "runs" / "good")
    assert run.wait(timeout=180) == "finished"
    line = protocol.event_line(0, protocol.Output(0, "stdout", "x" * 200))
    with open(run.dir / runlog.rank_events(0), "ab") as log:  # a chatty run: 64 MB of lines, then its last words
        block = line * ((1 << 20) // len(line))
        for _ in range(LOG_BYTES // len(block)):
            log.write(block)
        for text in ("the last but one", "the very last"):
            log.write(protocol.event_line(0, protocol.Output(0, "stdout", text)))
    (run.dir / runlog.SUMMARY).write_text('{"devices": "2 CPU ranks", "ranks": [0, 1], "metr')  # cut short

    said: list = []
    peak = _peak_of(lambda: said.append(run_main(capsys, "attach", str(run.dir), "--lines", "2")))
    code, out, err = said[0]
    assert (code, err) == (0, "")
    assert out.splitlines() == ["_says_hello: finished", "--- rank 0, last 2 lines ---", "the last but one",
                                "the very last", "--- result ---", repr(run.result(timeout=1))]
    assert peak < LOG_BYTES / 16, f"{peak:,} bytes at the peak for a {LOG_BYTES:,}-byte log"

    (run.dir / runlog.SUMMARY).write_bytes(b" " * (runlog.JSON_LIMIT + 1))  # a huge summary: damaged, not read
    peak = _peak_of(lambda: said.append(run_main(capsys, "runs", str(tmp_path / "runs"))))
    code, out, err = said[-1]
    assert code == 0 and " damaged " in out and f"{runlog.JSON_LIMIT + 1:,} bytes" in repr(nbtrain.runs(
        tmp_path / "runs")[0])
    assert peak < runlog.JSON_LIMIT / 4, f"{peak:,} bytes at the peak for a {runlog.JSON_LIMIT + 1:,}-byte summary"


def _sleeps():
    import time

    print("sleeping", flush=True)
    time.sleep(600)


@pytest.mark.slow
def test_cancel_in_a_shell_stops_a_run(tmp_path, no_leftovers):
    run = nbtrain.submit(_sleeps, devices=2, accelerator="cpu", run_dir=tmp_path / "sleeps")
    deadline = time.monotonic() + 180
    while "sleeping" not in run.logs() and time.monotonic() < deadline:
        time.sleep(0.2)
    cancelled = nbtrain_cli("cancel", str(run.dir))
    assert cancelled.returncode == 0, cancelled.stderr
    assert cancelled.stdout.startswith("_sleeps: cancelled")
    assert run.status == "cancelled"
    again = nbtrain_cli("cancel", str(run.dir))
    assert (again.returncode, again.stdout) == (0, "_sleeps: already cancelled; nothing to cancel\n")
    gone = nbtrain_cli("cancel", str(tmp_path / "nope"))
    assert gone.returncode == 2 and gone.stderr.startswith(f"nbtrain cancel: '{tmp_path / 'nope'}' does not exist")


@pytest.mark.slow
def test_python_dash_m_nbtrain_is_the_command():
    run = subprocess.run([sys.executable, "-m", "nbtrain", "-V"], capture_output=True, text=True, timeout=60)
    assert (run.returncode, run.stdout.strip()) == (0, f"nbtrain {version('nbtrain')}"), run.stderr
