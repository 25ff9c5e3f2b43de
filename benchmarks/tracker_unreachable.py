"""How long a run waits on a tracker server that does not answer, before its error: before/after.

A 2-rank CPU launch (ddp_fork) with `trackers=MLflow(tracking_uri=...)` or
`WandB(mode="online")` (WANDB_BASE_URL) pointed at a local port that is closed (connection
refused) or that accepts connections and never answers (a socket listening, never read). Timed
from the `launch` call to its error. "after": nbtrain's bounds (MLflow: each request 10 s, 2
retries; W&B: init_timeout 30 s). "before": the clients' own defaults, which nbtrain used until
now, set in the environment (where the user's settings win): MLflow 120 s per request, 7 retries,
back-off factor 2; W&B init_timeout 90 s. The "before" of a silent MLflow port takes about 20
minutes: `--quick` leaves the "before" runs out.

    python benchmarks/tracker_unreachable.py [--quick] [--no-save]
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import nbtrain  # noqa: E402
from _common import record, table  # noqa: E402

BEFORE = {"mlflow": {"MLFLOW_HTTP_REQUEST_TIMEOUT": "120", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "7",
                     "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "1.0"},
          "wandb": {"WANDB_INIT_TIMEOUT": "90"}}


def train():
    ctx = nbtrain.context()
    for i in ctx.progress(range(3)):
        ctx.log("loss", 1.0 / (i + 1))


def port(server: str) -> tuple[socket.socket | None, int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    number = s.getsockname()[1]
    if server == "closed":
        s.close()
        return None, number
    s.listen(64)
    return s, number


def time_to_error(tracker: str, server: str, settings: dict, run_dir: str) -> tuple[float, str]:
    held, number = port(server)
    url = f"http://127.0.0.1:{number}"
    env = {**settings, **({"WANDB_BASE_URL": url, "WANDB_API_KEY": "0" * 40} if tracker == "wandb" else {})}
    os.environ.update(env)
    chosen = nbtrain.MLflow(tracking_uri=url) if tracker == "mlflow" else nbtrain.WandB(mode="online")
    started = time.perf_counter()
    try:
        nbtrain.launch(train, trackers=chosen, devices=2, accelerator="cpu", strategy="ddp_fork", progress=False,
                       run_dir=run_dir, timeout=3600)
        said = "no error"
    except Exception as exc:
        said = str(exc).splitlines()[0]
    elapsed = time.perf_counter() - started
    for key in env:
        os.environ.pop(key, None)
    if held is not None:
        held.close()
    return elapsed, said


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="nbtrain's bounds only")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args(argv)
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory(prefix="nbtrain-bench-") as runs:
        for tracker in ("mlflow", "wandb"):
            for server in ("closed", "silent"):
                found = {}
                for variant in ("after",) if args.quick else ("after", "before"):
                    settings = BEFORE[tracker] if variant == "before" else {}
                    found[variant] = time_to_error(tracker, server, settings, f"{runs}/{tracker}-{server}-{variant}")
                    print(tracker, server, variant, f"{found[variant][0]:.1f} s", found[variant][1], flush=True)
                before = f"{found['before'][0]:.0f}" if "before" in found else "-"
                rows.append([tracker, server, before, f"{found['after'][0]:.0f}", found["after"][1][:160]])
    body = ("2 CPU ranks (ddp_fork), a tracker pointed at a local port that is closed or listens and never "
            "answers; seconds from the `launch` call to its error, one run each. Before: the clients' defaults "
            "(MLflow 120 s per request, 7 retries, back-off factor 2; W&B init_timeout 90 s); after: nbtrain's "
            "bounds for the run (MLflow 10 s, 2 retries; W&B init_timeout 30 s).\n\n"
            + table(["tracker", "port", "before s", "after s", "the error after"], rows))
    if args.no_save:
        print(body)
    else:
        record("A tracker server that does not answer (tracker_unreachable.py)", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
