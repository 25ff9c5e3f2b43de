"""A rank's stdout and stderr reach the cell in the order the rank wrote them.

What Python writes to a rank's stderr travels framed on its stdout pipe (`rank/process._Pipe`,
`common/output_reader._Frames`), and the kernel's display flushes one stream before writing the
other. The unit tests feed the reader real pipes; the kernel tests watch a real cell's stream
messages, in order, on every start, and Lightning's start-up lines.
"""
import importlib.util
import os

import pytest

from nbtrain.common import protocol
from nbtrain.common.output_reader import OutputReader, _Frames, frame_stderr


def test_frames_split_anywhere_come_back_whole_and_in_order():
    written = (b"out 0\n" + frame_stderr(b"err 0\n") + b"out 1\n" + frame_stderr("é 1\n".encode())
               + b"\x00nbtrain-done 3\n")
    for cut in range(1, len(written)):
        frames = _Frames("stdout")
        parts = frames.feed(written[:cut]) + frames.feed(written[cut:])
        merged: list[tuple[str, bytes]] = []
        for stream, data in parts:
            if merged and merged[-1][0] == stream:
                merged[-1] = (stream, merged[-1][1] + data)
            else:
                merged.append((stream, data))
        assert merged == [("stdout", b"out 0\n"), ("stderr", b"err 0\n"), ("stdout", b"out 1\n"),
                          ("stderr", "é 1\n".encode()), ("stdout", b"\x00nbtrain-done 3\n")], cut
        assert frames.pending == b"" and frames.left == 0


def test_the_reader_hands_on_a_pipes_two_streams_in_order():
    records = []
    reader = OutputReader(records.append)
    read, write = os.pipe()
    reader.add(read, 0, "stdout")
    reader.start()
    try:
        for i in range(50):
            os.write(write, f"out {i}\n".encode())
            os.write(write, frame_stderr(f"err {i}\n".encode()))
        os.write(write, frame_stderr(b"no newline at the end"))
        os.close(write)
        reader.drain(10)
    finally:
        reader.close()
    said = [(r.stream, r.text) for r in records if isinstance(r, protocol.Output)]
    expected = [pair for i in range(50) for pair in (("stdout", f"out {i}"), ("stderr", f"err {i}"))]
    assert said == expected + [("stderr", "no newline at the end")]


CHATTY = '''
%load_ext nbtrain
import sys, warnings, nbtrain

def chatty():
    for i in range(3):
        print(f"out {i}")
        print(f"err {i}", file=sys.stderr)
    warnings.warn("careful")
    print("after the warning")
'''


def ordered(kernel, code: str, timeout: float = 300) -> list[tuple[str, str]]:
    """The cell's stream messages, line by line, in the order the kernel sent them."""
    lines, errors = [], []

    def hook(msg):
        if msg["msg_type"] == "stream":
            lines.extend((msg["content"]["name"], line) for line in msg["content"]["text"].splitlines())
        elif msg["msg_type"] == "error":
            errors.append(msg["content"])

    kernel.client.execute_interactive(code, timeout=timeout, output_hook=hook)
    assert not errors, errors
    return lines


@pytest.fixture(scope="module")
def nb():
    from conftest import Kernel

    kernel = Kernel()
    _, _, error, _ = kernel.run(CHATTY, timeout=120)
    assert error is None, error
    yield kernel
    kernel.run("nbtrain.stop_template()")
    kernel.close()


@pytest.mark.slow
@pytest.mark.parametrize("start", ["fork", "template", "spawn", "torchrun"])
def test_a_ranks_prints_and_warnings_keep_their_order_in_the_cell(nb, start):
    lines = ordered(nb, f"_ = nbtrain.launch(chatty, devices=2, accelerator='cpu', start={start!r}, progress=False)")
    for rank in (0, 1):
        mine = [(stream, text[len(f"[rank {rank}] "):]) for stream, text in lines
                if text.startswith(f"[rank {rank}] ")]
        warning = [i for i, (_, text) in enumerate(mine) if "UserWarning: careful" in text]
        assert warning, mine
        mine = mine[:warning[0]] + [("stderr", "UserWarning")] + mine[warning[0] + 2:]  # its source line follows it
        assert mine == [("stdout", "out 0"), ("stderr", "err 0"), ("stdout", "out 1"), ("stderr", "err 1"),
                        ("stdout", "out 2"), ("stderr", "err 2"), ("stderr", "UserWarning"),
                        ("stdout", "after the warning")], (start, rank, lines)


LIGHTNING = '''
import os, torch, pytorch_lightning as pl
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

class Lit(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)
    def training_step(self, batch, _):
        x, y = batch
        return F.mse_loss(self.layer(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

def fit():
    data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 2)), batch_size=8)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(Lit(), data)
'''


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("pytorch_lightning") is None, reason="needs pytorch-lightning")
def test_lightnings_start_up_lines_come_before_its_model_summary(nb):
    _, _, error, _ = nb.run(LIGHTNING)
    assert error is None, error
    lines = [text for _, text in ordered(nb, "_ = nbtrain.launch(fit, devices=2, accelerator='cpu', start='fork', "
                                             "progress=False)")]
    distributed = [i for i, text in enumerate(lines) if "distributed_backend=gloo" in text]
    summary = [i for i, text in enumerate(lines) if "Trainable params" in text]  # the summary's table (rich or plain)
    assert distributed and summary and distributed[0] < summary[0], "\n".join(lines)
