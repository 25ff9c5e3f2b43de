"""What the doctor's always-on measurement costs: per collective, per training step, per stall check.

In one process (gloo, world 1, so no peer's speed shows), interleaved, the median of repeats, timed by
the thread's CPU time (time.thread_time: other jobs on a shared machine do not count):
  collective  dist.all_reduce of 4 floats, plain (torch's own function) vs counted (rank/doctor.py's
              wrapper: sequence number, op, shape, dtype, caller, wall time), and the wrapper alone
              around a no-op
  step        one SGD step of benchmarks/step_overhead.py's MLP (64x256x256x10, batch 64), its batch
              taken from a DataLoader and its loss all-reduced: plain vs measured (the loader's wait
              timed by ctx.loader's iterator, the all_reduce counted)
  stall check the supervisor's check per tick while nothing stalls (stall_after on the recent step
              time), and a rank's answer to `Where` (its main thread's user frame, read on request)
  DDP step    the same step with the MLP in DistributedDataParallel (DDP's default buckets),
              timed by the process's CPU time (gloo's threads and the hooks' callbacks count): torch's
              built-in C++ all-reduce (no hook) vs torch's own Python allreduce_hook registered vs the
              doctor's counting hook (rank/ddp_counting.py's count_ddp: torch's allreduce_hook, each bucket noted);
              and the counting alone, per bucket: the hook around a hook that returns a done future, on
              a stand-in for DDP's GradBucket (index, buffer, parameters), less that hook called bare
  functional  funcol.all_reduce of 4 floats and its wait (torch's functional collectives, which DTensor
              uses), torch's functions vs counted (rank/doctor.py's count_functional: the result's
              wrapping and its wait noted), and the counting alone: both wrappers around stand-ins
              that return at once, less the stand-ins called bare

    python benchmarks/doctor_overhead.py [--repeats 7] [--no-save]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import median, record  # noqa: E402
from nbtrain.rank import ddp_counting, doctor, tally  # noqa: E402


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                               torch.nn.ReLU(), torch.nn.Linear(256, 10))


# The calling thread's CPU time, not the wall clock: on a machine shared with other jobs, time spent
# waiting for a core is theirs, not the code's (torch runs one intra-op thread here, the loader none).
CLOCK = time.thread_time


def per_call(fn, arg, n: int) -> float:
    started = CLOCK()
    for _ in range(n):
        fn(arg)
    return (CLOCK() - started) / n


def steps(reduce, batches, n: int) -> float:
    torch.manual_seed(0)
    model, data = _mlp(), torch.utils.data.TensorDataset(torch.randn(64 * n, 64), torch.randint(0, 10, (64 * n,)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(data, batch_size=64)
    started = CLOCK()
    for x, y in batches(iter(loader)):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        reduce(loss.detach())
    return (CLOCK() - started) / n


def _commit() -> str:
    import subprocess

    found = subprocess.run(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return found.stdout.strip() or "unknown"


def ddp_steps(model, n: int) -> float:
    torch.manual_seed(0)
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    started = time.process_time()
    for _ in range(n):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return (time.process_time() - started) / n


class _Bucket:
    """What the counting hook asks of DDP's GradBucket."""

    def __init__(self, index: int, params: list) -> None:
        self._index, self._buffer, self._params = index, torch.zeros(4), params

    def index(self) -> int:
        return self._index

    def buffer(self):
        return self._buffer

    def parameters(self) -> list:
        return self._params


def counting_alone(n: int) -> float:
    """Seconds the counting adds to one bucket's all-reduce (a backward()'s first bucket, the dearer one)."""
    module = torch.nn.Module()
    module.module = _mlp()
    done = torch.futures.Future()
    done.set_result(torch.zeros(4))
    slot = ddp_counting.Slot(module, lambda state, bucket: done, None)
    bucket = _Bucket(0, list(module.module.parameters()))
    started = CLOCK()
    for _ in range(n):
        ddp_counting.bucket_reduced(slot, bucket)
    counted = CLOCK() - started
    started = CLOCK()
    for _ in range(n):
        bucket.index(), bucket.buffer(), slot.hook(None, bucket)
    return (counted - (CLOCK() - started)) / n


def forward_backward_counting(model, n: int) -> tuple[float, float]:
    """Seconds the counting adds to a DDP forward (its _pre_forward, counted vs torch's) and to a
    backward() call (torch.autograd.backward, counted vs torch's, on a one-element graph)."""
    x, leaf = torch.ones(64, 64), torch.ones(1, requires_grad=True)
    counted_pre, pre = type(model)._pre_forward, type(model)._pre_forward.__wrapped__
    counted_backward, backward = torch.autograd.backward, torch.autograd.backward.__wrapped__
    costs = []
    for fast, slow in ((lambda: pre(model, x)), (lambda: counted_pre(model, x))), \
            ((lambda: backward(leaf.sum())), (lambda: counted_backward(leaf.sum()))):
        started = CLOCK()
        for _ in range(n):
            fast()
        bare = CLOCK() - started
        started = CLOCK()
        for _ in range(n):
            slow()
        costs.append((CLOCK() - started - bare) / n)
    return costs[0], costs[1]


def functional_counting(n: int) -> float:
    """Seconds the counting adds to one functional collective: its two wrappers around stand-ins
    for torch's `_maybe_wrap_tensor` (returning a made result) and `wait_tensor` (returning its argument)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    t = torch.zeros(4)
    made = AsyncCollectiveTensor(t)
    wrap, wait = (lambda tensor: made), (lambda tensor: tensor)
    counted_wrap, counted_wait = doctor.functional_counters(wrap, wait, AsyncCollectiveTensor)
    started = CLOCK()
    for _ in range(n):
        counted_wait(counted_wrap(t))
    counted = CLOCK() - started
    started = CLOCK()
    for _ in range(n):
        wait(wrap(t))
    return (counted - (CLOCK() - started)) / n


def functional_all_reduce(t) -> None:
    import torch.distributed._functional_collectives as funcol

    funcol.all_reduce(t, "sum", dist.group.WORLD).wait()


def functional_pairs() -> dict:
    """torch's `_maybe_wrap_tensor` and `wait_tensor` as torch has them ("plain") and counted."""
    import torch.distributed._functional_collectives as funcol

    doctor.count_functional()
    counted = (funcol._maybe_wrap_tensor, funcol.wait_tensor)
    return {"funcol plain": tuple(f.__wrapped__ for f in counted), "funcol counted": counted}


def functional_steps(pair, t, n: int) -> float:
    import torch.distributed._functional_collectives as funcol

    funcol._maybe_wrap_tensor, funcol.wait_tensor = pair
    return per_call(functional_all_reduce, t, n)


def ddp_models():
    """The MLP in DDP three ways: no hook (torch's C++ all-reduce), torch's Python allreduce_hook, counted."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp_counting.count_ddp()
    models = {}
    for kind in ("ddp builtin", "ddp torch hook"):
        model = DDP.__new__(DDP)
        DDP.__init__.__wrapped__(model, _mlp())  # type: ignore[attr-defined]  # torch's own
        if kind == "ddp torch hook":
            model.register_comm_hook(None, allreduce_hook)
        models[kind] = model
    models["ddp counted"] = DDP(_mlp())
    return models


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29000 + os.getpid() % 1000))
    torch.set_num_threads(1)  # a rank of 2 on a 2-core machine, as step_overhead.py runs them
    dist.init_process_group("gloo", rank=0, world_size=1)
    plain = dist.all_reduce
    counted = doctor.counted_collective("all_reduce", plain)
    nop = lambda t: None  # noqa: E731
    wrapped_nop = doctor.counted_collective("all_reduce", nop)
    t = torch.zeros(4)
    models = ddp_models()
    pairs = functional_pairs()
    names = ("plain", "counted", "nop", "wrapped", "step plain", "step measured", *models)
    rows: dict[str, list[float]] = {k: [] for k in names}
    for _ in range(args.repeats):
        for kind, model in models.items():
            rows[kind].append(ddp_steps(model, 300))
        rows.setdefault("counting", []).append(counting_alone(20000))
        forward, backward = forward_backward_counting(models["ddp counted"], 20000)
        rows.setdefault("forward", []).append(forward)
        rows.setdefault("backward", []).append(backward)
        for kind, pair in pairs.items():
            rows.setdefault(kind, []).append(functional_steps(pair, t, 5000))
        rows.setdefault("funcol counting", []).append(functional_counting(100000))
        rows["plain"].append(per_call(plain, t, 20000))
        rows["counted"].append(per_call(counted, t, 20000))
        rows["nop"].append(per_call(nop, t, 200000))
        rows["wrapped"].append(per_call(wrapped_nop, t, 200000))
        rows["step plain"].append(steps(plain, lambda it: it, 200))
        rows["step measured"].append(steps(counted, tally.timed_batches, 200))
    from nbtrain.notebook.run.doctor import stall_after

    check = per_call(lambda _: stall_after(None, 0.01), None, 200000)
    n = 200000
    items = [None] * n
    started = CLOCK()
    for _ in iter(items):
        pass
    bare = (CLOCK() - started) / n
    started = CLOCK()
    for _ in tally.timed_batches(iter(items)):
        pass
    timed = (CLOCK() - started) / n - bare
    where = per_call(doctor.whereabouts, 0, 20000)
    buckets = models["ddp counted"].reducer._get_zeros_like_grad_buckets()
    del models
    dist.destroy_process_group()
    m = {k: median(v) for k, v in rows.items()}
    wrapper = m["wrapped"] - m["nop"]
    funcol_cost = m["funcol counted"] - m["funcol plain"]
    step_cost = (m["step measured"] - m["step plain"]) / m["step plain"]
    body = "\n".join([
        "| what | plain | measured | cost |", "|---|---|---|---|",
        f"| all_reduce (4 floats, world 1) | {m['plain'] * 1e6:.2f} µs | {m['counted'] * 1e6:.2f} µs | "
        f"{(m['counted'] - m['plain']) * 1e6:+.2f} µs |",
        f"| the counting wrapper alone (around a no-op) | {m['nop'] * 1e6:.3f} µs | {m['wrapped'] * 1e6:.3f} µs | "
        f"{wrapper * 1e6:+.3f} µs per collective |",
        f"| one step of step_overhead's MLP (loader batch, loss all-reduced) | {m['step plain'] * 1e3:.3f} ms | "
        f"{m['step measured'] * 1e3:.3f} ms | {step_cost:+.2%} |",
        f"| timing one batch of ctx.loader's iterator | | | {timed * 1e6:+.3f} µs per batch |",
        f"| per step, from its parts (one counted collective, one timed batch) | | | "
        f"{(wrapper + timed) * 1e6:+.3f} µs = {(wrapper + timed) / m['step plain']:.3%} of the step |",
        f"| the supervisor's stall check per tick (nothing stalled) | | {check * 1e6:.3f} µs | |",
        f"| a rank's answer to `Where` (asked only after `stall` s quiet) | | {where * 1e6:.1f} µs | |",
        f"| a DDP step of the MLP (DDP's default buckets: {len(buckets)}), torch's C++ all-reduce vs counted | "
        f"{m['ddp builtin'] * 1e3:.3f} ms | {m['ddp counted'] * 1e3:.3f} ms | "
        f"{(m['ddp counted'] - m['ddp builtin']) / m['ddp builtin']:+.2%} |",
        f"| the same with torch's Python allreduce_hook registered (what the counting hook calls) | "
        f"{m['ddp builtin'] * 1e3:.3f} ms | {m['ddp torch hook'] * 1e3:.3f} ms | "
        f"{(m['ddp torch hook'] - m['ddp builtin']) / m['ddp builtin']:+.2%} |",
        f"| the counting alone, per bucket (its parts, thread CPU time) | | | {m['counting'] * 1e6:+.2f} µs = "
        f"{m['counting'] * len(buckets) / m['step plain']:.3%} of step_overhead's step ({len(buckets)} bucket"
        f"{'s' if len(buckets) > 1 else ''}) |",
        f"| a DDP forward's and a backward() call's counting (a skipped backward(), no_sync()) | | | "
        f"{m['forward'] * 1e6:+.2f} µs + {m['backward'] * 1e6:+.2f} µs = "
        f"{(m['forward'] + m['backward']) / m['step plain']:.3%} of step_overhead's step |",
        f"| funcol.all_reduce (4 floats, world 1) and its wait: torch's vs counted | "
        f"{m['funcol plain'] * 1e6:.2f} µs | {m['funcol counted'] * 1e6:.2f} µs | "
        f"{funcol_cost * 1e6:+.2f} µs = {funcol_cost / m['funcol plain']:.1%} of the call, "
        f"{funcol_cost / m['step plain']:.2%} of step_overhead's step per functional collective |",
        f"| the functional counting alone (both wrappers, around stand-ins that return at once) | | | "
        f"{m['funcol counting'] * 1e6:+.3f} µs per collective |",
        "", f"Medians of {args.repeats} interleaved repeats, the calling thread's CPU time. Whole steps differ by "
        "several percent from run to run either way on a shared machine (the same code twice does too), so the "
        "per-step cost is read from its parts. Stall checks ask the ranks nothing until no progress message came "
        "for `stall` seconds; then one `Where` per rank when the stall would be due (the quietest rank's idle time "
        "subtracted), at most every 0.25 s. DDP rows: the process's CPU time (gloo's threads count), world 1: whole "
        "DDP steps move by more than the hook's cost from run to run, so the counting is read from its parts. "
        "Functional collectives: the whole call's difference is the one to read (the wrappers run between torch's "
        "own Python, several times slower than in a loop of their own, as the all_reduce rows show too). "
        f"Commit {_commit()}."])
    if args.no_save:
        print(body)
    else:
        record("The doctor's always-on measurement (doctor_overhead.py)", body)


if __name__ == "__main__":
    main()
