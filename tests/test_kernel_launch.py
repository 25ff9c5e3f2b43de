"""launch() from a real Jupyter kernel: notebook-defined code, failures, interrupts, leaks."""
import pytest

from conftest import CHILDREN, NET

pytestmark = pytest.mark.slow

SETUP = '''
import os, time, torch, psutil
import torch.nn.functional as F
import nbtrain

''' + NET + '''
scale = 3.0
square = lambda v: v * v * scale

def train(steps):
    ctx = nbtrain.context()
    model = ctx.setup(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in ctx.progress(range(steps)):
        loss = F.mse_loss(model(torch.randn(8, 4)), torch.zeros(8, 2))
        opt.zero_grad(); loss.backward(); opt.step()
        ctx.log("loss", loss, sync_dist=True)
    return model, square(ctx.rank + 1)

''' + CHILDREN


@pytest.fixture(scope="module")
def nb(kernel):
    _, _, error, _ = kernel.run(SETUP)
    assert error is None, error
    return kernel


@pytest.mark.parametrize("start", ["fork", "template"])
def test_notebook_defined_function_class_lambda_and_globals(nb, start):
    out, err, error, _ = nb.run(
        f"r = nbtrain.launch(train, 3, devices=2, accelerator='cpu', start='{start}', progress=False)")
    assert error is None, error
    assert nb.value("isinstance(r.value[0], Net), [v[1] for v in r.values], len(r.metrics('loss'))") == (True, [3.0, 12.0], 3)
    assert nb.value("children()") == []


def test_worker_error_shows_the_cells_line(nb):
    code = '''
def fails():
    ctx = nbtrain.context()
    if ctx.rank == 1:
        raise RuntimeError("rank one is unhappy")
    time.sleep(60)
    print("rank 0 was waited for")
nbtrain.launch(fails, devices=2, accelerator="cpu", start="template", progress=False)
'''
    out, err, error, _ = nb.run(code)
    assert "was waited for" not in out + err  # rank 0 was stopped, not left to finish its minute
    assert error["ename"] == "WorkerError"
    shown = "\n".join(error["traceback"])
    assert "rank 1 failed: RuntimeError: rank one is unhappy" in shown
    assert 'raise RuntimeError("rank one is unhappy")' in shown  # the cell's source, even in a spawned rank
    assert "supervisor.py" not in shown  # the launcher's own frames are not what the user needs
    assert nb.value("children()") == []


def test_timeout_from_a_kernel_shows_stacks(nb):
    code = '''
def hangs():
    ctx = nbtrain.context()
    ctx.barrier()
    if ctx.rank == 0:
        ctx.barrier()
    else:
        time.sleep(60)
nbtrain.launch(hangs, devices=2, accelerator="cpu", start="fork", timeout=5, progress=False)
'''
    _, _, error, _ = nb.run(code)
    shown = "\n".join(error["traceback"])
    assert "timed out after 5 s; still running: ranks [0, 1]" in shown
    assert "--- rank 1 stack ---" in shown and "--- rank 0 stack (waiting) ---" in shown and "in hangs" in shown
    assert "The others wait for rank 1." in shown
    assert nb.value("children()") == []


def test_interrupt_stops_every_rank_and_keeps_the_kernel(nb):
    asked = nb.client.execute("nbtrain.launch(lambda: print('sleeping', flush=True) or time.sleep(120), devices=2, "
                              "accelerator='cpu', start='fork', progress=False)")
    nb.wait_for_output(asked, "[rank 0] sleeping", "[rank 1] sleeping")
    nb.manager.interrupt_kernel()
    while True:  # wait for this execution's reply: within 30 s, not after the ranks' 2 minutes
        reply = nb.client.get_shell_msg(timeout=30)
        if reply["msg_type"] == "execute_reply":
            break
    assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
    assert reply["content"]["traceback"] == ["KeyboardInterrupt: interrupted; nbtrain stopped ranks [0, 1]."]
    assert nb.value("children()") == []
    assert nb.value("1 + 1") == 2


def test_fifty_launches_leak_nothing(nb):
    code = '''
me = psutil.Process()
quick = lambda: nbtrain.context().rank
nbtrain.launch(quick, devices=2, accelerator='cpu', start='fork', progress=False)
fds, threads = me.num_fds(), len(__import__("threading").enumerate())
for _ in range(50):
    assert nbtrain.launch(quick, devices=2, accelerator='cpu', start='fork', progress=False).values == [0, 1]
leak = (me.num_fds() - fds, len(__import__("threading").enumerate()) - threads, children(), "MASTER_PORT" in os.environ)
'''
    _, _, error, _ = nb.run(code, timeout=300)
    assert error is None, error
    assert nb.value("leak") == (0, 0, [], False)


def test_output_of_ranks_reaches_the_cell_tagged(nb):
    out, err, error, _ = nb.run('''
import sys
def talk():
    ctx = nbtrain.context()
    print("out", ctx.rank)
    print("err", ctx.rank, file=sys.stderr)
nbtrain.launch(talk, devices=2, accelerator='cpu', start='fork', progress=False)
''')
    assert error is None, error
    assert "[rank 0] out 0" in out and "[rank 1] out 1" in out
    assert "[rank 0] err 0" in err and "[rank 1] err 1" in err
