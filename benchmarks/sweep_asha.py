"""Trials stopped early: Optuna's successive halving and Hyperband through `nbtrain.sweep`, against
Ray Tune's ASHA, on Optuna's own example (`sweep_objective.py`'s pytorch_simple objective and its
synthetic FashionMNIST-shaped data), 16 trials of up to 9 epochs, 2 at once on 2 CPU cores.

- `nbtrain.sweep(objective, trials=16, devices=2, pruner=...)`: the objective unchanged, its
  `trial.report(accuracy, epoch)` / `trial.should_prune()` answered by the study in the notebook;
  `SuccessiveHalvingPruner(min_resource=1, reduction_factor=3)` and
  `HyperbandPruner(min_resource=1, max_resource=9, reduction_factor=3)`;
- Ray Tune: `ASHAScheduler(max_t=9, grace_period=1, reduction_factor=3)`, 16 random samples of
  the same space written out (Ray has no define-by-run space), 2 trials at once of 1 CPU each; the
  same objective, its trial a shim that reads Ray's config and reports to Ray (ASHA stops a trial
  itself); its actors reused from trial to trial, as nbtrain's warm processes are.

Random parameters on each side (seeded), so the two do not run the same trials: the table says
how many epochs each trained in all, and its wall time. Rounds are interleaved; `ray.init` is
measured apart.

    python benchmarks/sweep_asha.py [--rounds 2] [--note TEXT]
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
from sweep_objective import N_VALID, define_model, get_data  # noqa: E402

EPOCHS, TRIALS = 9, 16


def objective(trial):
    """optuna-examples' pytorch_simple objective, as in sweep_objective.py, for EPOCHS epochs."""
    import optuna
    import torch
    import torch.nn.functional as F

    model = define_model(trial)
    optimizer_name = trial.suggest_categorical("optimizer", ["Adam", "RMSprop", "SGD"])
    lr = trial.suggest_float("lr", 1e-5, 1e-1, log=True)
    optimizer = getattr(torch.optim, optimizer_name)(model.parameters(), lr=lr)
    train_loader, valid_loader = get_data()
    accuracy = 0.0
    for epoch in range(EPOCHS):
        model.train()
        for data, target in train_loader:
            optimizer.zero_grad()
            F.nll_loss(model(data.view(data.size(0), -1)), target).backward()
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


class RayTrial:
    """The objective's trial under Ray Tune: parameters from Ray's config, reports to Ray."""

    def __init__(self, config: dict):
        self.config = config

    def _get(self, name, *args, **kwargs):
        return self.config[name]

    suggest_int = suggest_float = suggest_categorical = _get

    def report(self, value: float, step: int) -> None:
        from ray import tune

        tune.report({"accuracy": value, "epoch": step})

    def should_prune(self) -> bool:
        return False  # ASHA stops the trial itself


def run_nbtrain(pruner, seed: int) -> tuple[float, int, int]:
    import optuna

    import nbtrain

    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=seed), pruner=pruner)
    started = time.perf_counter()
    nbtrain.sweep(objective, trials=TRIALS, devices=2, accelerator="cpu", study=study, progress=False)
    wall = time.perf_counter() - started
    trials = study.get_trials()
    return wall, sum(len(t.intermediate_values) for t in trials), sum(t.state.name == "PRUNED" for t in trials)


def run_ray(seed: int, storage: str) -> tuple[float, int, int]:
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    def trainable(config):
        import torch

        torch.set_num_threads(1)
        objective(RayTrial(config))

    space = {"n_layers": tune.randint(1, 4), "optimizer": tune.choice(["Adam", "RMSprop", "SGD"]),
             "lr": tune.loguniform(1e-5, 1e-1),
             **{f"n_units_l{i}": tune.randint(4, 129) for i in range(3)},
             **{f"dropout_l{i}": tune.uniform(0.2, 0.5) for i in range(3)}}
    scheduler = ASHAScheduler(time_attr="training_iteration", max_t=EPOCHS, grace_period=1, reduction_factor=3)
    tuner = tune.Tuner(tune.with_resources(trainable, {"cpu": 1}), param_space=space,
                       tune_config=tune.TuneConfig(metric="accuracy", mode="max", scheduler=scheduler,
                                                   num_samples=TRIALS, max_concurrent_trials=2, reuse_actors=True,
                                                   search_alg=tune.search.BasicVariantGenerator(random_state=seed)),
                       run_config=tune.RunConfig(storage_path=storage, verbose=0))
    started = time.perf_counter()
    results = tuner.fit()
    wall = time.perf_counter() - started
    assert not results.errors, results.errors
    epochs = [r.metrics.get("training_iteration", 0) for r in results]
    return wall, sum(epochs), sum(e < EPOCHS for e in epochs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    import optuna

    import nbtrain

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    nbtrain.warm_up(preload=["optuna"])
    import ray

    ray_start = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    ray_start = time.perf_counter() - ray_start
    names = ["nbtrain.sweep, SuccessiveHalvingPruner", "nbtrain.sweep, HyperbandPruner", "Ray Tune, ASHAScheduler"]
    runs: dict[str, list[tuple[float, int, int]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as storage:
        try:
            for seed in range(args.rounds):
                runs[names[0]].append(run_nbtrain(optuna.pruners.SuccessiveHalvingPruner(
                    min_resource=1, reduction_factor=3), seed))
                runs[names[1]].append(run_nbtrain(optuna.pruners.HyperbandPruner(
                    min_resource=1, max_resource=EPOCHS, reduction_factor=3), seed))
                runs[names[2]].append(run_ray(seed, storage))
                print({k: v[-1] for k, v in runs.items()}, flush=True)
        finally:
            ray.shutdown()
    rows = [[name, f"{median([r[0] for r in values]):.2f}", f"{median([r[1] for r in values]):.0f}",
             f"{median([r[2] for r in values]):.0f}", "; ".join(f"{w:.2f} s, {e}, {p}" for w, e, p in values)]
            for name, values in runs.items()]
    body = table([f"{TRIALS} trials of up to {EPOCHS} epochs, 2 at once", "wall s (median)",
                  "epochs trained (median)", "stopped early (median)", "rounds (s, epochs, stopped)"], rows)
    text = (f"Optuna's pytorch_simple objective (synthetic FashionMNIST-shaped data), {TRIALS} trials of up to "
            f"{EPOCHS} epochs on 2 CPU slots / 2 Ray trials of 1 CPU; random parameters seeded by the round, each "
            f"side its own; {args.rounds} interleaved rounds. ray.init {ray_start:.2f} s once, not in the table. "
            "The machine is shared with other jobs: rounds vary.")
    record("Sweep with early stopping: Optuna's pruners against Ray Tune's ASHA (sweep_asha.py)",
           body + "\n\n" + text + (f"\n\n{args.note}" if args.note else ""))


if __name__ == "__main__":
    main()
