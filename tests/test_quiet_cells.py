"""No warning of nbtrain's own making in a cell; third-party start-up chatter once per launch.

The unit tests read the script mode's generated bootstrap and the chatter rules; the kernel
tests run real launches (profile=True, script mode with TMPDIR set, Lightning, DeepSpeed) and
read the cell.
"""
import importlib.util
import os
import warnings

import pytest

from nbtrain.common import protocol
from nbtrain.notebook.run.chatter import Chatter
from nbtrain.placements.script import _BOOTSTRAP_TEXT


@pytest.mark.parametrize("tmpdir", [None, "/tmp/somewhere"])
def test_the_generated_rank_script_compiles_without_a_warning(tmpdir):
    text = _BOOTSTRAP_TEXT.format(path=["/x"], job_dir="/tmp/job", tmpdir=tmpdir, umask=0o022)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a SyntaxWarning (`"..." is None`) becomes an error here
        compile(text, "bootstrap.py", "exec")


def test_start_up_lines_every_rank_writes_show_once_and_trace_points_not_at_all():
    chatter = Chatter()
    lines = [(0, "USDT:2026-11-26 01:58:54 9257:9257 SyncActivityProfilerHandler.cpp:52] profiler_start"),
             (0, "STAGE:2026-11-26 01:59:47 10195:10195 SyncActivityProfilerHandler.cpp:51] Completed Stage: Warm Up"),
             (0, "Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/2"),
             (1, "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2"),
             (1, "[2026-11-26 02:00:19,240] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator "
                 "to CPU. If you have GPU or other accelerator, we were unable to detect it."),
             (0, "[2026-11-26 02:00:19,241] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator "
                 "to CPU. If you have GPU or other accelerator, we were unable to detect it."),
             (0, "my own line"), (1, "my own line"), (None, "USDT: the launcher's own line is never dropped")]
    shown = [(rank, text[:30]) for rank, text in lines if chatter.shows(protocol.Output(rank, "stderr", text))]
    assert shown == [(0, "Initializing distributed: GLOB"), (1, "[2026-11-26 02:00:19,240] [WAR"),
                     (0, "my own line"), (1, "my own line"), (None, "USDT: the launcher's own line ")]


SETUP = '''
%load_ext nbtrain
import os, torch, nbtrain

def steps():
    model = nbtrain.context().setup(torch.nn.Linear(4, 2))
    for _ in nbtrain.context().progress(range(3)):
        model(torch.randn(2, 4)).sum().backward()
    return 1
'''


@pytest.fixture(scope="module")
def nb():
    from conftest import Kernel

    kernel = Kernel()
    _, _, error, _ = kernel.run(SETUP, timeout=120)
    assert error is None, error
    yield kernel
    kernel.close()


def cell(kernel, code: str) -> str:
    out, err, error, _ = kernel.run(code, timeout=300)
    assert error is None, f"{error}\n{err[-2000:]}"
    return out + err


@pytest.mark.slow
def test_a_profiled_run_shows_no_profiler_trace_points(nb, tmp_path):
    shown = cell(nb, "_r = nbtrain.launch(steps, devices=2, accelerator='cpu', start='fork', profile=True, "
                     f"run_dir={str(tmp_path)!r})")
    assert "profiler_start" not in shown and "USDT" not in shown, shown
    assert nb.value("_r.profile is not None")  # the profile itself was taken


@pytest.mark.slow
def test_script_mode_with_tmpdir_set_shows_no_syntax_warning(nb, tmp_path):
    os.chmod(tmp_path, 0o700)
    shown = cell(nb, f"os.environ['TMPDIR'] = {str(tmp_path)!r}\n"
                     "try:\n"
                     "    _r = nbtrain.launch(steps, devices=2, accelerator='cpu', start='torchrun', progress=False)\n"
                     "finally:\n"
                     "    del os.environ['TMPDIR']")
    assert "Warning" not in shown, shown
    assert nb.value("_r.values") == [1, 1]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("pytorch_lightning") is None, reason="needs pytorch-lightning")
def test_lightnings_initializing_distributed_shows_once_per_launch(nb):
    cell(nb, '''
import pytorch_lightning as pl
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
class Lit(pl.LightningModule):
    def __init__(self):
        super().__init__(); self.layer = torch.nn.Linear(4, 2)
    def training_step(self, batch, _):
        return F.mse_loss(self.layer(batch[0]), batch[1])
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
def fit():
    pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False).fit(
        Lit(), DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 2)), batch_size=4))
''')
    shown = cell(nb, "_r = nbtrain.launch(fit, devices=2, accelerator='cpu', start='fork', progress=False)")
    assert shown.count("Initializing distributed") == 1, shown


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
def test_deepspeeds_accelerator_warning_shows_once_per_launch(nb):
    cell(nb, "def with_deepspeed():\n"
             "    from deepspeed.accelerator import get_accelerator\n"
             "    return get_accelerator().device_name()\n")
    shown = cell(nb, "_r = nbtrain.launch(with_deepspeed, devices=2, accelerator='cpu', start='spawn', progress=False)")
    assert shown.count("Setting accelerator to CPU") == 1, shown
