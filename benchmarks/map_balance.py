"""A map over skewed work, 2 workers, in one process: how close each runner gets to the even share.

The items: `--heavy` items of `--heavy-s` seconds first, then `--light` items of `--light-s`
seconds (time.sleep: the scheduling is measured, not the machine's two busy cores). The even
share is the total work over 2 workers, the best any runner can do; a static split (contiguous
halves) puts every heavy item on one worker.

- nbtrain.map(devices=2): a worker per CPU slot, each a launch of its own (start included);
- Ranks.map on 2 live ranks (started before, not counted);
- ipyparallel's load-balanced view, `map_sync` on 2 engines (started before, not counted);
- Accelerate's `split_between_processes` in `notebook_launcher(num_processes=2)` (start included),
  results gathered with `gather_object`.

    pip install -e ".[bench]" && python benchmarks/map_balance.py [--rounds 3]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import median, record, table  # noqa: E402

COSTS: list[float] = []


def work(x: int) -> int:
    import time

    time.sleep(COSTS[x])
    return x


def costs(heavy: int, heavy_s: float, light: int, light_s: float) -> list[float]:
    return [heavy_s] * heavy + [light_s] * light


def run_nbtrain(items: list[int]) -> float:
    import nbtrain

    started = time.perf_counter()
    out = nbtrain.map(work, items, devices=2, accelerator="cpu", progress=False)
    assert out == items
    return time.perf_counter() - started


def run_ranks(ranks, items: list[int]) -> float:
    started = time.perf_counter()
    out = ranks.map(work, items)
    assert out == items
    return time.perf_counter() - started


def run_ipyparallel(view, items: list[int]) -> float:
    started = time.perf_counter()
    out = view.map_sync(work, items)
    assert list(out) == items
    return time.perf_counter() - started


def accelerate_worker(items: list[int], out: list) -> None:
    from accelerate import PartialState
    from accelerate.utils import gather_object

    state = PartialState()
    with state.split_between_processes(items) as mine:
        done = [work(x) for x in mine]
    gathered = gather_object(done)
    if state.is_main_process:
        out.append(gathered)


def run_accelerate(items: list[int]) -> float:
    from accelerate import notebook_launcher

    started = time.perf_counter()
    notebook_launcher(accelerate_worker, (items, []), num_processes=2)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heavy", type=int, default=8)
    parser.add_argument("--heavy-s", type=float, default=0.4)
    parser.add_argument("--light", type=int, default=32)
    parser.add_argument("--light-s", type=float, default=0.02)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    COSTS[:] = costs(args.heavy, args.heavy_s, args.light, args.light_s)
    items = list(range(len(COSTS)))
    even = sum(COSTS) / 2
    half = len(items) // 2
    static = max(sum(COSTS[:half + len(items) % 2]), sum(COSTS[half + len(items) % 2:]))

    import ipyparallel as ipp

    import nbtrain

    nbtrain.warm_up()
    started = time.perf_counter()
    ranks = nbtrain.Ranks(devices=2, accelerator="cpu", progress=False)
    ranks.push(COSTS=COSTS)
    ranks_start = time.perf_counter() - started
    started = time.perf_counter()
    cluster = ipp.Cluster(n=2, log_level=40)
    client = cluster.start_and_connect_sync()
    client.wait_for_engines(2, timeout=120)
    client[:].push({"COSTS": COSTS}, block=True)
    view = client.load_balanced_view()
    ipp_start = time.perf_counter() - started
    names = ["nbtrain.map(devices=2), workers started per map", "Ranks.map, 2 live ranks",
             "ipyparallel load_balanced_view().map_sync, 2 engines",
             "Accelerate split_between_processes, notebook_launcher(2)"]
    times: dict[str, list[float]] = {n: [] for n in names}
    try:
        for _ in range(args.rounds):
            times[names[0]].append(run_nbtrain(items))
            times[names[1]].append(run_ranks(ranks, items))
            times[names[2]].append(run_ipyparallel(view, items))
            times[names[3]].append(run_accelerate(items))
            print({k: f"{v[-1]:.2f}" for k, v in times.items()}, flush=True)
    finally:
        ranks.close()
        cluster.stop_cluster_sync()
    rows = [[name, f"{median(values):.2f}", f"{median(values) / even:.2f}x", ", ".join(f"{v:.2f}" for v in values)]
            for name, values in times.items()]
    body = table(["map over skewed items, 2 workers", "wall s (median)", "vs even share", "rounds (s)"], rows)
    text = (f"{len(items)} items: {args.heavy} of {args.heavy_s} s first, then {args.light} of {args.light_s} s "
            f"(sleeps); even share {even:.2f} s, a static split of contiguous halves {static:.2f} s "
            f"({static / even:.2f}x). {args.rounds} interleaved rounds. Started once, not in the table: "
            f"2 live ranks {ranks_start:.2f} s, 2 ipyparallel engines {ipp_start:.2f} s.")
    record("Map over skewed work (map_balance.py)", body + "\n\n" + text + (f"\n\n{args.note}" if args.note else ""))


if __name__ == "__main__":
    main()
