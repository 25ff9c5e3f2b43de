"""Optuna's own example, unchanged, three ways: 8 CPU-bound trials of optuna-examples'
`pytorch/pytorch_simple.py` objective (FashionMNIST replaced by a synthetic set of the same
shapes: 28x28 inputs, 10 classes, 30 batches of 128 to train, 10 to validate; fewer epochs).

- `nbtrain.sweep(objective, trials=8, devices=2, accelerator="cpu")`: the objective as Optuna
  calls it (`objective(trial)`), each trial a call on its slot's warm process (one per slot,
  started by the sweep, stopped at its end) with the slot's share of the cores (here: 1 thread
  each, on a core of its own);
- `study.optimize(objective, n_trials=8)`: one after another, in this process;
- `study.optimize(objective, n_trials=8, n_jobs=2)`: two threads of this process.

The same 8 parameter sets are enqueued for all three (so all do the same work); no pruning.
Rounds are interleaved; the median is reported, and each round's sweep against that round's
`n_jobs=2` (paired: the shared machine's load changes from round to round). Sequential Optuna
runs in the first `--sequential` rounds only (each trial on torch's threads in this process: the
slowest by far). Then what a trial costs beyond its objective: sweeps of a no-op objective
(one `suggest_float`) of 2 and of 2 + 2k trials on 2 slots, the difference over k (each slot's
k more trials), beside Optuna's `n_jobs=2` the same way. The template starts once, before the
rounds.

    python benchmarks/sweep_objective.py [--rounds 7] [--sequential 2] [--epochs 3] [--note TEXT]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import median, record, table  # noqa: E402

BATCHSIZE, CLASSES, N_TRAIN, N_VALID = 128, 10, 128 * 30, 128 * 10
EPOCHS = [3]


def define_model(trial):
    import torch.nn as nn

    n_layers = trial.suggest_int("n_layers", 1, 3)
    layers = []
    in_features = 28 * 28
    for i in range(n_layers):
        out_features = trial.suggest_int(f"n_units_l{i}", 4, 128)
        layers.append(nn.Linear(in_features, out_features))
        layers.append(nn.ReLU())
        p = trial.suggest_float(f"dropout_l{i}", 0.2, 0.5)
        layers.append(nn.Dropout(p))
        in_features = out_features
    layers.append(nn.Linear(in_features, CLASSES))
    layers.append(nn.LogSoftmax(dim=1))
    return nn.Sequential(*layers)


def get_data():
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    x = torch.rand(N_TRAIN + N_VALID, 1, 28, 28, generator=g)
    y = torch.randint(0, CLASSES, (N_TRAIN + N_VALID,), generator=g)
    train = DataLoader(TensorDataset(x[:N_TRAIN], y[:N_TRAIN]), batch_size=BATCHSIZE, shuffle=True)
    valid = DataLoader(TensorDataset(x[N_TRAIN:], y[N_TRAIN:]), batch_size=BATCHSIZE, shuffle=True)
    return train, valid


def objective(trial):
    import optuna
    import torch
    import torch.nn.functional as F

    model = define_model(trial)
    optimizer_name = trial.suggest_categorical("optimizer", ["Adam", "RMSprop", "SGD"])
    lr = trial.suggest_float("lr", 1e-5, 1e-1, log=True)
    optimizer = getattr(torch.optim, optimizer_name)(model.parameters(), lr=lr)
    train_loader, valid_loader = get_data()
    for epoch in range(EPOCHS[0]):
        model.train()
        for data, target in train_loader:
            data = data.view(data.size(0), -1)
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
        model.eval()
        correct = 0
        with torch.no_grad():
            for data, target in valid_loader:
                pred = model(data.view(data.size(0), -1)).argmax(dim=1, keepdim=True)
                correct += pred.eq(target.view_as(pred)).sum().item()
        accuracy = correct / N_VALID
        trial.report(accuracy, epoch)
        if trial.should_prune():
            raise optuna.exceptions.TrialPruned()
    return accuracy


def parameter_sets(count: int) -> list[dict]:
    """The same trials for all three: drawn once by a seeded random sampler."""
    import optuna

    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    sets = []
    for _ in range(count):
        trial = study.ask()
        model = define_model(trial)
        del model
        trial.suggest_categorical("optimizer", ["Adam", "RMSprop", "SGD"])
        trial.suggest_float("lr", 1e-5, 1e-1, log=True)
        sets.append(dict(trial.params))
        study.tell(trial, 0.0)
    return sets


def study_of(sets: list[dict]):
    import optuna

    study = optuna.create_study(direction="maximize", pruner=optuna.pruners.NopPruner())
    for params in sets:
        study.enqueue_trial(params)
    return study


def run_nbtrain(sets: list[dict], storage: str) -> float:
    import nbtrain

    study = study_of(sets)
    started = time.perf_counter()
    nbtrain.sweep(objective, trials=len(sets), devices=2, accelerator="cpu", study=study, progress=False)
    return time.perf_counter() - started


def run_optuna(sets: list[dict], jobs: int) -> float:
    study = study_of(sets)
    started = time.perf_counter()
    study.optimize(objective, n_trials=len(sets), n_jobs=jobs)
    return time.perf_counter() - started


def noop(trial):
    return trial.suggest_float("x", 0.0, 1.0)


def per_trial_ms(run, extra: int, rounds: int) -> list[float]:
    """What each slot's `extra` more trials cost, per trial: sweeps of 2 and of 2 + 2 * extra no-op trials."""
    costs = []
    for _ in range(rounds):
        few, many = run(2), run(2 + 2 * extra)
        costs.append((many - few) / extra * 1000)
    return costs


def sweep_noop(count: int) -> float:
    import optuna

    import nbtrain

    started = time.perf_counter()
    nbtrain.sweep(noop, trials=count, devices=2, accelerator="cpu", study=optuna.create_study(), progress=False)
    return time.perf_counter() - started


def optuna_noop(count: int) -> float:
    import optuna

    study = optuna.create_study()
    started = time.perf_counter()
    study.optimize(noop, n_trials=count, n_jobs=2)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--sequential", type=int, default=2, help="rounds that also run sequential Optuna")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--noop", type=int, default=16, help="each slot's extra no-op trials, for the cost per trial")
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    EPOCHS[0] = args.epochs
    import optuna
    import torch

    import nbtrain

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sets = parameter_sets(args.trials)
    threads = torch.get_num_threads()
    one = time.perf_counter()
    objective(optuna.trial.FixedTrial(sets[0]))  # warm, and one trial alone in this process
    one = time.perf_counter() - one
    warm = time.perf_counter()
    nbtrain.warm_up(preload=["optuna"])  # as the first sweep of an objective(trial) leaves it
    warm = time.perf_counter() - warm
    names = ["nbtrain.sweep, 2 CPU slots", "optuna optimize (sequential)", "optuna optimize(n_jobs=2)"]
    times: dict[str, list[float]] = {name: [] for name in names}
    paired: list[float] = []
    with tempfile.TemporaryDirectory() as storage:
        for number in range(args.rounds):
            times[names[0]].append(run_nbtrain(sets, storage))
            if number < args.sequential:
                times[names[1]].append(run_optuna(sets, 1))
            times[names[2]].append(run_optuna(sets, 2))
            paired.append(times[names[0]][-1] / times[names[2]][-1])
            print({k: f"{v[-1]:.2f}" for k, v in times.items() if v}, f"sweep/n_jobs=2 {paired[-1]:.2f}", flush=True)
    costs = {"nbtrain.sweep, 2 CPU slots": per_trial_ms(sweep_noop, args.noop, 3),
             "optuna optimize(n_jobs=2)": per_trial_ms(optuna_noop, args.noop, 3)}
    base = median(times[names[1]])
    rows = [[name, f"{median(values):.2f}", f"{median(values) / base:.2f}x",
             f"{median(paired):.2f}x" if name == names[0] else "1.00x" if name == names[2] else "",
             ", ".join(f"{v:.2f}" for v in values)] for name, values in times.items()]
    body = table([f"{args.trials} trials of Optuna's pytorch_simple objective", "wall s (median)", "vs sequential",
                  "vs n_jobs=2 (paired, median)", "rounds (s)"], rows)
    body += "\n\n" + table(["a no-op objective, 2 slots or 2 threads", "cost per trial ms (median)", "rounds (ms)"],
                            [[name, f"{median(values):.1f}", ", ".join(f"{v:.1f}" for v in values)]
                             for name, values in costs.items()])
    text = (f"{args.trials} trials of optuna-examples' pytorch_simple objective, unchanged (a synthetic set of "
            f"FashionMNIST's shapes, {args.epochs} epochs; {one:.2f} s alone with torch's {threads} threads), the "
            f"same enqueued parameters for all three, no pruning; {args.rounds} interleaved rounds (sequential in "
            f"the first {args.sequential}). Each sweep's time includes starting its 2 warm processes and stopping "
            f"them. nbtrain's warm template, Optuna preloaded as a sweep of objective(trial) leaves it: {warm:.2f} s "
            f"once, not in the table. Cost per trial: sweeps of 2 and {2 + 2 * args.noop} no-op trials, the "
            f"difference over {args.noop} (each slot's share), 3 rounds. The machine is shared with other jobs: "
            "rounds vary.")
    record("Sweep of Optuna's own objective(trial), CPU-bound (sweep_objective.py)",
           body + "\n\n" + text + (f"\n\n{args.note}" if args.note else ""))


if __name__ == "__main__":
    main()
