"""A sweep of N short trials, the same trials several ways, in one process, 2 CPU cores:

- nbtrain.sweep on 2 CPU slots (each trial a call on its slot's warm process);
- Optuna's own `study.optimize(n_jobs=1)` (trials one after another in this process) and
  `study.optimize(n_jobs=2)` (two threads of this process; torch releases the GIL);
- with `--ray`, Ray Tune, 2 trials at once (1 CPU each), `tune.Tuner(...).fit()`;
- with `--unpinned`, nbtrain.sweep with each trial free to run on any core (the trial function
  sets its process's affinity back to every core this process has), against the slots' own
  share: 1 thread and a core of its own each.

Each trial trains a small MLP for a fixed number of steps on one thread (torch.set_num_threads(1)
in the trial, the same code for all) and reports its loss every 10 steps. With `--wait S`,
each step also waits S seconds (as a trial whose step runs on its own GPU leaves the CPU free):
the slots' overlap is measured apart from a shared machine's contention for its 2 cores. The same N
parameter sets (lr) are given to all (Optuna: enqueued; Ray: a grid over them), no pruning,
so all do the same work. Rounds are interleaved; the median round is reported, and each round's
sweep against that round's `n_jobs=2` (paired: the shared machine's load changes from round to
round). Start-up that happens once per session (nbtrain's template, `ray.init`) is measured apart.

    python benchmarks/sweep_throughput.py [--trials 16] [--steps 1500] [--rounds 3] [--unpinned] [--ray]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import median, record, table  # noqa: E402

WAIT = [0.0]  # seconds each step waits (--wait)


def train(lr: float, steps: int, report) -> float:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x, y = torch.randn(256, 32), torch.randn(256, 1)
    loss = None
    for step in range(steps):
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if WAIT[0]:
            time.sleep(WAIT[0])
        if step % 10 == 9:
            report(step, loss.item())
    return loss.item()


def nbtrain_trial(steps: int, lr: float) -> float:
    import nbtrain

    ctx = nbtrain.context()
    return train(lr, steps, lambda step, value: ctx.log("loss", value, step=step))


def nbtrain_unpinned_trial(steps: int, cpus: tuple, lr: float) -> float:
    """`nbtrain_trial` on any of `cpus`, not on its slot's own core."""
    os.sched_setaffinity(0, cpus)
    return nbtrain_trial(steps, lr)


def run_nbtrain(lrs: list[float], steps: int, unpinned: bool = False) -> float:
    import functools

    import optuna

    import nbtrain

    study = optuna.create_study()
    for lr in lrs:
        study.enqueue_trial({"lr": lr})
    fn = functools.partial(nbtrain_trial, steps)
    if unpinned:
        fn = functools.partial(nbtrain_unpinned_trial, steps, tuple(sorted(os.sched_getaffinity(0))))
    started = time.perf_counter()
    nbtrain.sweep(fn, {"lr": optuna.distributions.FloatDistribution(1e-4, 1.0)}, trials=len(lrs), metric="loss",
                  devices=2, accelerator="cpu", study=study, progress=False)
    return time.perf_counter() - started


def run_optuna(lrs: list[float], steps: int, jobs: int = 1) -> float:
    import optuna

    def objective(trial):
        lr = trial.suggest_float("lr", 1e-4, 1.0)
        return train(lr, steps, lambda step, value: trial.report(value, step))

    study = optuna.create_study()
    for lr in lrs:
        study.enqueue_trial({"lr": lr})
    started = time.perf_counter()
    study.optimize(objective, n_trials=len(lrs), n_jobs=jobs)
    return time.perf_counter() - started


def run_ray(lrs: list[float], steps: int, storage: str) -> float:
    from ray import tune

    def trainable(config):
        train(config["lr"], steps, lambda step, value: tune.report({"loss": value, "step": step}))

    tuner = tune.Tuner(tune.with_resources(trainable, {"cpu": 1}), param_space={"lr": tune.grid_search(lrs)},
                       tune_config=tune.TuneConfig(metric="loss", mode="min", max_concurrent_trials=2,
                                                   reuse_actors=True),
                       run_config=tune.RunConfig(storage_path=storage, verbose=0))
    started = time.perf_counter()
    results = tuner.fit()
    assert not results.errors, results.errors
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--wait", type=float, default=0.0, help="seconds each step waits (0: CPU-bound)")
    parser.add_argument("--ray", action="store_true", help="Ray Tune too (about 20 s a round here)")
    parser.add_argument("--unpinned", action="store_true", help="the sweep again, its trials on any core")
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    WAIT[0] = args.wait
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    lrs = [round(0.001 * 1.25 ** i, 6) for i in range(args.trials)]  # none diverges
    train(0.01, 10, lambda *_: None)  # torch imported and warm: the time of one trial alone, next
    one = time.perf_counter()
    train(0.01, args.steps, lambda *_: None)
    one = time.perf_counter() - one

    import nbtrain

    warm = time.perf_counter()
    nbtrain.warm_up()
    warm = time.perf_counter() - warm
    ray_start = None
    if args.ray:
        import ray

        ray_start = time.perf_counter()
        ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
        ray_start = time.perf_counter() - ray_start
    sweep, unpinned, jobs1, jobs2, tune = ("nbtrain.sweep, 2 CPU slots", "nbtrain.sweep, trials not pinned",
                                         "optuna optimize(n_jobs=1)", "optuna optimize(n_jobs=2)",
                                         "Ray Tune, 2 at once")
    runs = {sweep: lambda: run_nbtrain(lrs, args.steps)}
    if args.unpinned:
        runs[unpinned] = lambda: run_nbtrain(lrs, args.steps, unpinned=True)
    runs[jobs1] = lambda: run_optuna(lrs, args.steps, 1)
    runs[jobs2] = lambda: run_optuna(lrs, args.steps, 2)
    times: dict[str, list[float]] = {name: [] for name in runs}
    with tempfile.TemporaryDirectory() as storage:
        if args.ray:
            runs[tune] = lambda: run_ray(lrs, args.steps, storage)
            times[tune] = []
        try:
            for _ in range(args.rounds):
                for name, run in runs.items():
                    times[name].append(run())
                print({k: f"{v[-1]:.2f}" for k, v in times.items()}, f"load {os.getloadavg()[0]:.1f}", flush=True)
        finally:
            if args.ray:
                ray.shutdown()
    base = median(times[jobs1])
    rows = []
    for name, values in times.items():
        wall = median(values)
        paired = median([a / b for a, b in zip(values, times[jobs2])])
        rows.append([name, f"{wall:.2f}", f"{args.trials / wall * 60:.0f}", f"{wall / base:.2f}x", f"{paired:.2f}x",
                     ", ".join(f"{v:.2f}" for v in values)])
    body = table(["sweep of the same trials", "wall s (median)", "trials/min", "time vs optuna n_jobs=1",
                  "time vs n_jobs=2 (paired, median)", "rounds (s)"], rows)
    waits = f", each step then waiting {args.wait:g} s" if args.wait else ""
    once = f"nbtrain's warm template {warm:.2f} s" + (f", ray.init {ray_start:.2f} s" if ray_start is not None else "")
    text = (f"{args.trials} trials, each {args.steps} SGD steps of a 32-128-1 MLP on one thread{waits} "
            f"({one:.2f} s alone), "
            f"loss reported every 10 steps; same lr values for all, no pruning; {args.rounds} interleaved rounds. "
            f"Once per session, not in the table: {once}. The machine is shared with other jobs: rounds vary.")
    kind = f"trials that wait (--wait {args.wait:g})" if args.wait else "CPU-bound trials"
    record(f"Sweep throughput, {kind} (sweep_throughput.py)",
           body + "\n\n" + text + (f"\n\n{args.note}" if args.note else ""))


if __name__ == "__main__":
    main()
