"""Live ranks (nbtrain.Ranks, %nbtrain start, %%ranks) in a real Jupyter kernel, 2 CPU ranks, gloo:
state kept, objects both ways, output, failures, interrupts, stuck ranks, post-mortem debugging,
lifetime. Tests that restart the ranks build the state they need first."""
import time

import pytest

from conftest import CHILDREN, NET

pytestmark = pytest.mark.slow

SETUP = '''
%load_ext nbtrain
import os, time, torch, psutil
import torch.nn.functional as F
import nbtrain
os.environ["NBTRAIN_PROGRESS"] = "text"

''' + NET + '''
lr = 0.1

''' + CHILDREN

STATE = '''%%ranks
import torch.distributed as dist
t = torch.tensor([ctx.rank + 1.0])
dist.all_reduce(t)                 # the process group is ready in the first cell
model = ctx.setup(Net())           # Net and lr come from the notebook
opt = torch.optim.SGD(model.parameters(), lr=lr)
t.item()
'''


def ok(nb, code, **kw):
    out, err, error, results = nb.run(code, **kw)
    assert error is None, "\n".join(error["traceback"])
    return plain(out), err


def plain(text: str) -> str:
    """Without terminal colours (pdb's listing is coloured)."""
    import re

    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def failing(nb, code, ename="WorkerError", **kw):
    out, err, error, _ = nb.run(code, **kw)
    assert error is not None and error["ename"] == ename, (out, err, error)
    return "\n".join(error["traceback"]), out


def wait_for_reply(nb, timeout=30):
    while True:
        reply = nb.client.get_shell_msg(timeout=timeout)
        if reply["msg_type"] == "execute_reply":
            return reply


@pytest.fixture(scope="module")
def nb(kernel):
    ok(kernel, SETUP)
    out, _ = ok(kernel, "%nbtrain start --devices 2 --accelerator cpu")
    assert "2 live ranks (fork, 2 CPU ranks, gloo) ready" in out
    # Started without torch._dynamo (~1-2 s): the kernel imports it only once its ranks need it.
    assert kernel.value("'torch._dynamo' in __import__('sys').modules") is False
    yield kernel
    ok(kernel, "%nbtrain stop")
    assert kernel.value("children()") == []


def test_process_group_ready_state_kept_names_from_the_notebook(nb):
    out, _ = ok(nb, STATE)
    assert "[rank 0] 3.0" in out and "[rank 1] 3.0" in out  # the last value, per rank
    assert nb.value("ranks.eval('t.item()')") == [3.0, 3.0]  # state kept between calls
    assert nb.value("ranks.eval('type(model).__name__')") == ["DistributedDataParallel"] * 2
    assert nb.value("ranks.world_size, len(ranks), nbtrain.Ranks.current() is ranks") == (2, 2, True)


def test_objects_travel_both_ways(nb):
    ok(nb, STATE)
    ok(nb, "ranks.push(scale=3, twice=lambda v: 2 * v)")
    assert nb.value("ranks.eval('twice(scale) + ctx.rank')") == [6, 7]
    assert nb.value("[isinstance(m, Net) for m in ranks.pull('model')]") == [True, True]  # the notebook's own class, unwrapped
    assert nb.value("ranks[1].pull('t').item(), ranks[1].eval('ctx.rank')") == (3.0, 1)
    ok(nb, "ranks[0].push(only_here=1)")
    assert nb.value("ranks.eval('\"only_here\" in globals()')") == [True, False]


def test_names_from_the_notebook_follow_it_and_the_ranks_own_win(nb):
    ok(nb, "def follow_me():\n    return 1")
    out, _ = ok(nb, "%%ranks\nfollow_me()")
    assert "[rank 0] 1" in out
    ok(nb, "def follow_me():\n    return 2")  # redefined in the notebook: the ranks follow
    out, _ = ok(nb, "%%ranks\nfollow_me()")
    assert "[rank 0] 2" in out and "[rank 1] 2" in out
    ok(nb, "%%ranks\ndef follow_me():\n    return 3")  # defined on the ranks: theirs wins from now on
    ok(nb, "def follow_me():\n    return 4")
    out, _ = ok(nb, "%%ranks\nfollow_me()")
    assert "[rank 0] 3" in out and "[rank 1] 3" in out


def test_an_object_of_a_class_only_the_ranks_have_is_refused_in_one_line(nb):
    ok(nb, "%%ranks\nclass OnlyHere:\n    pass\nthing = OnlyHere()")
    shown, _ = failing(nb, "ranks.pull('thing')")
    message = plain(shown)
    assert "rank 0 returned an object of class 'OnlyHere', which was defined on the ranks only" in message, message
    assert "Define the class in the notebook too" in message and "_dill.py" not in message
    assert nb.value("ranks.eval('type(thing).__name__')") == ["OnlyHere", "OnlyHere"]  # the ranks are fine


def test_run_uses_the_ranks_own_names_and_shows_progress(nb):
    ok(nb, STATE)
    code = '''
def train_epoch(steps):
    for _ in ctx.progress(range(steps), desc="step"):
        loss = F.mse_loss(model(torch.randn(8, 4)), torch.zeros(8, 2))   # model, opt: the rank's own
        opt.zero_grad(); loss.backward(); opt.step()
        ctx.log("loss", loss, sync_dist=True)
    return ctx.rank
r = ranks.run(train_epoch, 3)
'''
    out, _ = ok(nb, code)
    assert "train_epoch on live ranks" in out and "finished" in out
    assert nb.value("r.values, len(r.metrics('loss')), r.metrics('loss') == r.metrics('loss', rank=1)") == ([0, 1], 3, True)
    # The weights changed on the ranks, and stayed there: DDP kept the replicas equal.
    assert nb.value("ranks.eval('round(float(model.module.layer.weight.sum()), 5)')[0] == "
                    "ranks.eval('round(float(model.module.layer.weight.sum()), 5)')[1]")


def test_output_streams_live_tagged_by_rank(nb, tmp_path):
    # The ranks print, then wait (a minute at most) for a file this test makes only once it has
    # seen their first lines: streamed while the cell ran, the late lines say they saw the file.
    go = tmp_path / "go"
    msg_id = nb.client.execute(f"%%ranks\nimport os, time\nprint('early', ctx.rank, flush=True)\n"
                               f"began = time.monotonic()\n"
                               f"while not os.path.exists({str(go)!r}) and time.monotonic() - began < 60:\n"
                               f"    time.sleep(0.05)\nprint('late', ctx.rank, os.path.exists({str(go)!r}))")
    shown = nb.wait_for_output(msg_id, "[rank 0] early 0", "[rank 1] early 1")
    assert "late" not in shown
    go.touch()
    shown += nb.wait_for_output(msg_id, "[rank 0] late 0", "[rank 1] late 1")
    assert wait_for_reply(nb)["content"]["status"] == "ok"
    assert "[rank 0] late 0 True" in shown and "[rank 1] late 1 True" in shown, shown


def test_a_failing_cell_names_the_rank_and_leaves_state_as_it_was(nb):
    ok(nb, "%%ranks\nkeep = 41")
    shown, _ = failing(nb, '%%ranks\nif ctx.rank == 1:\n    raise ValueError("rank one says no")\nkeep += 1')
    assert "rank 1 failed: ValueError: rank one says no" in shown
    cell = nb.value("len(get_ipython().history_manager.input_hist_raw)") - 2  # In[] of the failing cell
    assert f"Cell In[{cell}], line 2" in shown and 'raise ValueError("rank one says no")' in shown
    assert nb.value("ranks.eval('keep')") == [42, 41]
    assert nb.value("type(nbtrain.Ranks.current()._pool).__name__") == "SteerablePool"


def test_interrupt_reaches_every_rank_and_keeps_state(nb):
    ok(nb, "%%ranks\nkept = ctx.rank\nseen = None")
    asked = nb.client.execute("%%ranks\ntry:\n    print('sleeping', flush=True)\n    time.sleep(60)\n"
                              "except KeyboardInterrupt:\n    seen = time.time()\n    raise")
    nb.wait_for_output(asked, "[rank 0] sleeping", "[rank 1] sleeping")
    asked = time.time()
    nb.manager.interrupt_kernel()
    reply = wait_for_reply(nb)  # within 30 s, not after the ranks' minute; how soon: benchmarks/live_ranks.py
    assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
    shown = "\n".join(reply["content"]["traceback"])  # where the ranks were, not nbtrain's wait loop
    assert "the live ranks [0, 1] were interrupted; their state is kept." in shown
    assert "--- ranks 0, 1 ---" in shown and "time.sleep(60)" in shown and "supervisor" not in shown
    seen = nb.value("ranks.eval('seen')")
    assert all(s is not None and s >= asked for s in seen), seen  # KeyboardInterrupt inside the rank's code
    assert nb.value("ranks.eval('kept')") == [0, 1]


def test_a_rank_that_cannot_be_interrupted_is_diagnosed_and_the_ranks_restarted(nb):
    ok(nb, STATE)
    asked = nb.client.execute("%%ranks\nprint('waiting', flush=True)\nif ctx.rank == 0:\n"
                              "    dist.barrier()   # rank 1 never comes\nelse:\n    time.sleep(60)")
    nb.wait_for_output(asked, "[rank 0] waiting", "[rank 1] waiting")
    nb.manager.interrupt_kernel()
    reply = wait_for_reply(nb, timeout=45)  # not after rank 1's minute; how soon: benchmarks/live_ranks.py
    assert reply["content"]["ename"] == "KeyboardInterrupt"
    assert "ranks [0] did not return, so the live ranks are restarted" in "\n".join(reply["content"]["traceback"])
    out, _ = ok(nb, "print(ranks)")
    assert "ready" in out
    assert nb.value("ranks.eval('ctx.rank')") == [0, 1]
    shown, _ = failing(nb, "ranks.eval('t')")  # the old state is gone
    assert "NameError" in shown


def test_the_stuck_ranks_stacks_are_shown(nb):
    ok(nb, STATE)
    shown, out = failing(nb, "%%ranks --timeout 3\nif ctx.rank == 0:\n    dist.barrier()\nelse:\n    time.sleep(60)")
    assert "timed out after 3 s" in shown
    assert "--- rank 0 stack (waiting) ---" in shown and "in barrier" in shown  # rank 0 waits in the barrier
    assert "rank 1 is not in a collective" in shown  # said before the interrupt freed rank 1
    assert "restarted" in shown and "state is lost" in shown
    assert nb.value("ranks.eval('1')") == [1, 1]


def test_a_timeout_interrupts_and_keeps_state(nb):
    ok(nb, "%%ranks\nstays = ctx.rank + 10")
    shown, _ = failing(nb, "%%ranks --timeout 2\ntime.sleep(60)")
    assert "timed out after 2 s" in shown and "restarted" not in shown
    assert nb.value("ranks.eval('stays')") == [10, 11]


def test_post_mortem_debugging_in_the_failed_rank(nb):
    code = "%%ranks\ndef f(v):\n    y = v * 2\n    if ctx.rank == 1:\n        raise ValueError(f'bad {y}')\n    return y\nf(21)"
    failing(nb, code)
    out, _ = ok(nb, "%debug", answers=["p y", "p v", "q"])
    assert nb.prompts == ["(Pdb rank 1) "] * 3
    assert "42" in out and "21" in out and "raise ValueError" in out
    assert "nbtrain/rank/loop.py" not in out  # the debugger starts in the user's frames
    out, _ = ok(nb, "ranks[1].debug()", answers=["p ctx.rank", "c"])
    assert "\n1\n" in out


def test_the_debugger_opens_in_the_users_frame_above_library_code(nb):
    # A failure inside torch (F.linear): pdb opened in torch/nn/modules/linear.py.
    failing(nb, "%%ranks\nlayer = torch.nn.Linear(4, 2)\ndef forward(x):\n    out = layer(x)\n    return out\n"
                "forward(torch.randn(3, 5))")
    out, _ = ok(nb, "ranks[0].debug()", answers=["p x.shape", "q"])
    assert "out = layer(x)" in out and "torch.Size([3, 5])" in out, out
    assert "site-packages" not in out.split("(Pdb")[0]
    assert "> Cell In[" in out and "ipykernel_" not in out, out  # where, as IPython's debugger says it


def test_debug_commands_given_in_advance_need_no_prompt(nb):
    # Notebook 06 stopped at a pdb prompt under Run All; commands given up front end the session.
    failing(nb, "%%ranks\nw = ctx.rank * 10\nraise ValueError(w)")
    out, _ = ok(nb, "ranks[1].debug(commands=['p w + 1', 'q'])")
    assert nb.prompts == [] and "(Pdb rank 1) p w + 1\n11" in out, out
    shown, _ = failing(nb, "ranks[1].debug(commands='q')", ename="TypeError")
    assert "give a list of pdb commands" in shown


def test_breakpoint_on_one_rank(nb):
    out, _ = ok(nb, "%%ranks --rank 0\nz = 5\nbreakpoint()\nprint('after', z)", answers=["p z", "z = 7", "c"])
    assert nb.prompts[0] == "(Pdb rank 0) " and "5" in out and "[rank 0] after 7" in out


def test_a_dead_rank_is_named_and_work_refused_until_restart(nb):
    shown, _ = failing(nb, "%%ranks --rank 1\nos._exit(3)")
    assert "rank 1 failed: exited with code 3" in shown and ".restart()" in shown
    shown, _ = failing(nb, "ranks.eval('1')", ename="PoolBroken")
    assert "rank 1 ended: exited with code 3" in shown
    ok(nb, "ranks.restart()")
    assert nb.value("ranks.eval('ctx.rank')") == [0, 1]
    # The new ranks; the old ones are gone (the kernel's one watcher is no child of the kernel's).
    assert len(nb.value("children()")) == 2
    shown, _ = failing(nb, "ranks[0].debug()")
    assert "rank 0 has no failure to debug" in shown


def test_launch_works_beside_live_ranks(nb):
    ok(nb, STATE)  # the ranks built DDP and an optimizer, importing torch._dynamo each
    # A launch whose code names nothing that needs it forks from a kernel that imported it first, as
    # its ranks needed it: they share it.
    ok(nb, "r = nbtrain.launch(lambda: (nbtrain.context().rank, 'torch._dynamo' in __import__('sys').modules), "
           "devices=2, accelerator='cpu', start='fork', progress=False)")
    assert nb.value("r.values, ranks.eval('ctx.rank')") == ([(0, True), (1, True)], [0, 1])


def test_magic_mistakes_are_one_line_usage_errors(nb):
    _, err = ok(nb, "%%ranks --rank 9\n1")  # IPython prints a UsageError as one line, with no traceback
    assert err.strip() == "UsageError: --rank [9]: the live ranks are 0 .. 1."
    ok(nb, "%nbtrain stop")
    _, err = ok(nb, "%%ranks\n1")
    assert err.startswith("UsageError: no live ranks") and "%nbtrain start" in err
    _, err = ok(nb, "%nbtrain start --devices 0 --accelerator cpu")
    assert err.startswith("UsageError: devices='0': a count must be positive")
    _, err = ok(nb, "%nbtrain start --devices 2 --partition gpu")
    assert err.startswith("UsageError: --partition do not apply with no --cluster") and "--cluster slurm:" in err
    _, err = ok(nb, "%nbtrain start --cluster slurm --start fork")
    assert err.startswith("UsageError: --start fork apply to ranks started on this machine; with --cluster slurm the "
                          "cluster starts them")
    ok(nb, "%nbtrain start --devices 2 --accelerator cpu")
