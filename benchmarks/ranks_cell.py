"""A `%%ranks` cell against ipyparallel's `%%px`, the same cell (`x = 1`) on 2 CPU ranks and 2
engines of one real Jupyter kernel, interleaved one cell at a time, beside the same cell run plainly
in the kernel (the floor: the kernel's own round trip).

- cell: the client's execute request until the kernel is idle again, as a notebook sees a cell;
- in the kernel: the magic alone (`run_cell_magic`), in blocks, interleaved.

Each row gives the median and the 90th percentile. Live ranks as a notebook starts them
(`nbtrain.Ranks(devices=2)`, the default live view); ipyparallel's `Cluster(n=2)` activated
for `%%px`.

    pip install -e ".[bench]" && python benchmarks/ranks_cell.py [--cells 300]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import Kernel, median, record, table  # noqa: E402

SETUP = '''
%load_ext nbtrain
import time, statistics, nbtrain
import ipyparallel as ipp
ranks = nbtrain.Ranks(devices=2, accelerator="cpu")
cluster = ipp.Cluster(n=2, log_level=40)
rc = cluster.start_and_connect_sync(activate=True)
rc.wait_for_engines(2, timeout=120)

def block(magic, n):  # the magic alone, n times: its median and 90th percentile, ms
    ip, values = get_ipython(), []
    for _ in range(n):
        t = time.perf_counter(); ip.run_cell_magic(magic, "", "x = 1"); values.append(time.perf_counter() - t)
    values.sort()
    return f"{statistics.median(values) * 1000} {values[int(len(values) * 0.9)] * 1000}"
'''

CELLS = {"plain cell (the kernel's floor)": "x = 1", "%%ranks cell": "%%ranks\nx = 1", "%%px cell": "%%px\nx = 1"}


def p90(values: list[float]) -> float:
    return sorted(values)[int(len(values) * 0.9)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", type=int, default=300)
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    kernel = Kernel()
    cells: dict[str, list[float]] = {name: [] for name in CELLS}
    inside: dict[str, list[tuple[float, float]]] = {"ranks": [], "px": []}
    try:
        kernel.run(SETUP)
        for code in CELLS.values():  # each once, untimed: first-call costs are not the round trip
            kernel.run(code)
        for i in range(args.cells):
            for name, code in CELLS.items():
                start = time.perf_counter()
                kernel.client.execute_interactive(code, timeout=60, output_hook=lambda msg: None)
                cells[name].append(time.perf_counter() - start)
            if i % (args.cells // 5 or 1) == 0:
                for magic in inside:
                    middle, tail = map(float, kernel.run(f"print(block({magic!r}, 40))").split()[-2:])
                    inside[magic].append((middle, tail))
        kernel.run("ranks.close(); cluster.stop_cluster_sync()")
    finally:
        kernel.close()
    px = median(cells["%%px cell"])
    rows = [[name, f"{median(v) * 1000:.2f}", f"{p90(v) * 1000:.2f}", f"{median(v) / px:.2f}x", str(len(v))]
            for name, v in cells.items()]
    px_inside = median([m for m, _ in inside["px"]])
    for magic, blocks in inside.items():
        middle = median([m for m, _ in blocks])
        rows.append([f"in the kernel, run_cell_magic('{magic}')", f"{middle:.2f}",
                     f"{median([t for _, t in blocks]):.2f}", f"{middle / px_inside:.2f}x", str(40 * len(blocks))])
    body = table(["2 CPU ranks / 2 engines, one kernel, `x = 1`", "median ms", "p90 ms", "vs %%px", "n"], rows)
    ours = median(cells["%%ranks cell"])
    floor = median(cells["plain cell (the kernel's floor)"])
    body += (f"\n\nTarget: a `%%ranks` cell <= 0.7x `%%px` ({ours / px:.2f}x here); above the kernel's floor "
             f"%%ranks adds {(ours - floor) * 1000:.2f} ms, %%px {(px - floor) * 1000:.2f} ms.")
    record("A %%ranks cell against %%px (ranks_cell.py)", body + (f"\n\n{args.note}" if args.note else ""))


if __name__ == "__main__":
    main()
