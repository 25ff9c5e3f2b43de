"""What the SLURM and Ray tests share: a display that proves events arrive while ranks run,
and the rank function it is proved with. Importable by the test process and by kernels (the
ranks import it too: they get the notebook's import path)."""
import os
import time

import nbtrain
from nbtrain.display.text import QuietDisplay


class Recorder(QuietDisplay):
    """A display that keeps what it is shown, and raises a flag (a file the ranks wait for)
    once it has seen every rank's progress and metric while they all still run."""

    def __init__(self, flag):
        self.flag, self.notes, self.lines, self.seen_live = str(flag), [], [], False

    def note(self, text):
        self.notes.append(text)

    def output(self, rank, stream, text):
        self.lines.append((rank, text))

    def update(self, state):
        views = state.ranks.values()
        if all(v.status == "running" and v.metrics and v.bars for v in views) and not self.seen_live:
            self.seen_live = True
            open(self.flag, "w").close()


def wait_for_the_notebook(flag):
    """Report progress, a metric and a line, then wait until the notebook has seen them."""
    ctx = nbtrain.context()
    for _ in ctx.progress(range(1), desc="waiting"):
        ctx.log("alive", 1.0)
        print(f"rank {ctx.rank} waits for the notebook to see it")
    deadline = time.monotonic() + 60
    while not os.path.exists(flag):
        if time.monotonic() > deadline:
            raise TimeoutError("the notebook never saw this rank's events while it ran")
        time.sleep(0.05)
    return ctx.rank


def one_rank_stalls():
    """Rank 0 sleeps while the others wait for it in a barrier: a run for `timeout=`."""
    import torch.distributed as dist

    ctx = nbtrain.context()
    ctx.barrier()
    if ctx.rank == 0:
        time.sleep(120)
    dist.barrier()


def stack_report_problems(text: str, timeout: int) -> list[str]:
    """What a timed-out run's WorkerError lacks of the expected stacks (empty: all there)."""
    # Rank 0 sleeps and is blamed; rank 1 waits for it in a barrier, and its stack says so.
    wanted = [f"timed out after {timeout} s", "The others wait for rank 0", "--- rank 0 stack ---",
              "in one_rank_stalls", "--- rank 1 stack (waiting) ---", "in barrier"]
    return [w for w in wanted if w not in text]
