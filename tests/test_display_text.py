"""The text displays: GPU tables, rank lines, summaries, and a real launch read as a log."""
import os
import re
import subprocess
import sys
import textwrap

import pytest

from nbtrain import gpus
from nbtrain.common.inventory import Gpu, GpuProcess, StaticInventory
from nbtrain.common.protocol import BatchSize, Hello, Metric, Progress
from nbtrain.display.text import LineDisplay, QuietDisplay, gpu_table, rank_line, summary_lines
from nbtrain.notebook.run.runmodel import RunState

GiB = 2**30


def test_gpu_table_shows_remapping_memory_and_processes(monkeypatch):
    inventory = StaticInventory([
        Gpu(0, "Tesla T4", "GPU-a", "0000:01:00.0", 0, 15 * GiB, 0),
        Gpu(1, "Tesla T4", "GPU-b", "0000:02:00.0", 3 * GiB, 15 * GiB, 77, (GpuProcess(321, "python", 3 * GiB),)),
    ])
    table = str(gpus(inventory))
    assert table.splitlines()[0].split()[:3] == ["GPU", "name", "memory"]
    assert "321 python 3.0G" in table and "77%" in table
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert "0 (phys 1)" in str(gpus(inventory))
    assert gpu_table([]).startswith("no GPU visible")


def _state() -> RunState:
    state = RunState("ddp_fork on 2 CPU ranks, gloo", [0, 1])
    for rank in (0, 1):
        state.handle(Hello(rank, 10 + rank))
        state.handle(BatchSize(rank, 8, 16))
        state.handle(Progress(rank, 0, "epoch", 1, 3, False))
        state.handle(Progress(rank, 1, "batch", 5, 10, False))
        state.handle(Metric(0, rank, "loss", 0.5, True))
    state.fail(1, "RuntimeError: out of patience\nmore detail")
    return state


def test_rank_line_and_summary():
    state = _state()
    assert rank_line(state.ranks[0]) == "rank 0  running  epoch 1/3 batch 5/10  loss=0.5"
    assert rank_line(state.ranks[1]).endswith("RuntimeError: out of patience")
    head, *rows = summary_lines(state, ok=False)
    assert head.startswith("nbtrain: ddp_fork on 2 CPU ranks, gloo: failed in ")
    assert head.endswith("effective batch size 16 (8 per rank x 2 ranks)") and len(rows) == 2


def test_stopped_and_interrupted_ranks_read_as_such():
    state = _state()
    view = state.ranks[0]  # as RunState leaves a rank stopped because rank 1 failed
    view.status, view.detail = "stopped", "stopped (rank 1 failed)"
    view.reason = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] " + "Connection closed by peer " * 5
    line = rank_line(view, state, final=True)
    assert line.startswith("rank 0  stopped (rank 1 failed)  epoch 1/3 batch 5/10  loss=0.5  RuntimeError: [")
    assert line.endswith("…") and len(line) < 160  # its own message, clipped
    assert summary_lines(state, ok=False)[0].startswith("nbtrain: ddp_fork on 2 CPU ranks, gloo: failed in ")
    interrupted = RunState("single on CPU", [0])
    interrupted.handle(Hello(0, None))
    head, row = summary_lines(interrupted, ok=False)
    assert ": interrupted in " in head and row == "  rank 0  stopped (interrupted)"


def test_rank_line_shows_step_rate_and_memory():
    from nbtrain.common.protocol import Vital

    state = _state()
    vital = Vital(3.0, 0, 12.5, 300 * 2**20, None, None, None)
    assert rank_line(state.ranks[0], vital=vital) == "rank 0  running  epoch 1/3 batch 5/10  12.5 it/s  RSS 300 MiB  loss=0.5"
    gpu = Vital(3.0, 0, 12.5, 300 * 2**20, 3 * GiB, 87, 2)
    assert "12.5 it/s  GPU 2 3.0 GiB 87%  loss=0.5" in rank_line(state.ranks[0], vital=gpu)


def test_output_keeps_its_stream_and_rank_tag(capsys):
    display = QuietDisplay()
    display.output(0, "stdout", "to stdout")
    display.output(1, "stderr", "to stderr")
    display.output(None, "stdout", "untagged")
    out, err = capsys.readouterr()
    assert out == "[rank 0] to stdout\nuntagged\n" and err == "[rank 1] to stderr\n"


def test_line_display_writes_whole_lines_at_its_interval(capsys):
    display = LineDisplay(interval=3600)
    state = _state()
    display.start(state)
    for _ in range(100):
        display.update(state)  # within the interval: nothing
    display.finish(state, ok=False)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "nbtrain: ddp_fork on 2 CPU ranks, gloo" and len(lines) == 4


LAUNCH = textwrap.dedent("""
    import sys
    import nbtrain

    def train():
        ctx = nbtrain.context()
        print(f"hello from {ctx.rank}")
        print(f"careful on {ctx.rank}", file=sys.stderr)
        for _ in ctx.progress(range(2), desc="epoch"):
            for i in ctx.progress(range(3), desc="batch"):
                ctx.log("loss", 1.0 / (1 + i), sync_dist=True)
        return ctx.rank

    if __name__ == "__main__":
        print("values", nbtrain.launch(train, devices=2, accelerator="cpu", strategy="ddp", start="fork").values)
""")


def _run(tmp_path, **env) -> subprocess.CompletedProcess:
    script = tmp_path / "job.py"
    script.write_text(LAUNCH)
    environ = {k: v for k, v in os.environ.items() if k != "NBTRAIN_PROGRESS"}
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={**environ, **env})


@pytest.mark.slow
def test_launch_outside_jupyter_reads_as_a_log(tmp_path):
    done = _run(tmp_path)  # pipes, not a TTY: line display
    assert done.returncode == 0, done.stderr
    out, err = done.stdout, done.stderr
    assert "[rank 0] hello from 0" in out and "[rank 1] hello from 1" in out
    assert "[rank 0] careful on 0" in err and "[rank 1] careful on 1" in err
    assert "\nnbtrain: ddp on 2 CPU ranks, gloo: finished in " in out, out
    # The step rate and memory show when the run lasted long enough to sample them.
    assert re.search(r"  rank 1  finished  epoch 2/2 batch 3/3  (\S+ it/s  )?(RSS \S+ \S+  )?loss=0.3333", out)
    assert "values [0, 1]" in out
    assert "\x1b" not in out + err and "\r" not in out + err  # no cursor movement in a log


@pytest.mark.slow
def test_progress_switched_off_by_environment(tmp_path):
    done = _run(tmp_path, NBTRAIN_PROGRESS="0")
    assert done.returncode == 0, done.stderr
    assert "[rank 1] hello from 1" in done.stdout and "[rank 1] careful on 1" in done.stderr
    assert "finished in" not in done.stdout


def test_a_rank_before_its_first_step_reads_first_step_not_a_rate():
    from nbtrain.display.text import rank_line
    from nbtrain.notebook.run.runmodel import RunState

    state = RunState("ddp on 2 CPU ranks", [0, 1])
    state.handle(Hello(0, 123, "node"))
    state.handle(Progress(0, 0, "step", 0, 10, False))
    line = rank_line(state.ranks[0], state)
    assert "first step..." in line and "it/s" not in line, line
