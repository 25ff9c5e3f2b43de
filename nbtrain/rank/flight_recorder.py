"""NCCL's Flight Recorder, read by the doctor: the collectives NCCL itself ran, whoever issued them.

The doctor counts a rank's collectives where Python passes (`doctor.py`). On NCCL, torch's Flight
Recorder also records every collective ProcessGroupNCCL issues, from Python or not: DDP's reducer,
FSDP2's, compiled code's. Each entry has its process group, its sequence number in that group,
its op (`profiling_name`, "nccl:all_reduce"), its tensors' sizes and dtypes, and its state
("scheduled", "started" — only with TORCH_NCCL_ENABLE_TIMING=1, which records a start event — or
"completed", as NCCL's watchdog finds it). So on a stall, each rank's last collective not
completed says how far that rank got, even inside backward() or a compiled graph: the rank whose
last one is behind the others' is the one they wait for.

Only on nccl (NBTRAIN_BACKEND): on gloo, torch 2.13's recorder never marks an entry started or
completed (every one stays "scheduled": `doctor.py`), so nothing here runs there. The recorder is on by default in
recent torch (2,000 entries); `turn_on` sets that size where the user set none, for a torch whose
default was 0. Reading it (`summary`) dumps it as JSON without stacks, only the entries not
completed unless none is, in a thread of its own waited for `DUMP_WAIT` at most: a rank that
cannot dump in time says nothing of it rather than nothing at all.
"""
from __future__ import annotations

import json
import os
import threading
from collections.abc import MutableMapping

BUFFER_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")  # torch reads the first set
BUFFER = "2000"  # entries: torch's own default where it has one
DUMP_WAIT = 0.4  # seconds; the notebook waits 1 s for the whole answer (`hang_checks.WHERE_WAIT`)
# torch's dumps, newest first: NCCL's own recorder (NCCL builds), then the generic one (torch >= 2.8)
DUMPS = ("_dump_nccl_trace_json", "_dump_fr_trace_json")


def on_nccl(environ: MutableMapping[str, str] = os.environ) -> bool:
    return environ.get("NBTRAIN_BACKEND") == "nccl"


def turn_on(environ: MutableMapping[str, str] = os.environ) -> None:
    """On nccl, the recorder on in this rank's environment (read when its process group is made),
    unless the user sized it; anything else is left as it is."""
    if on_nccl(environ) and not any(name in environ for name in BUFFER_VARS):
        environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] = BUFFER


def summarise(dump: dict) -> tuple:
    """A recorder dump (torch's JSON or pickle layout: `entries`, each with `process_group`,
    `collective_seq_id`/`p2p_seq_id`, `profiling_name`, `input_sizes`, `input_dtypes`, `state`)
    as (op, sequence number, sizes, dtypes, process group, state, entries not completed): its last
    entry not completed, else its last; () when it has none."""
    entries = dump.get("entries") or []
    if not entries:
        return ()
    pending = [e for e in entries if e.get("state") != "completed"]
    last = (pending or entries)[-1]
    op = str(last.get("profiling_name", "")).split(":", 1)[-1] or "collective"
    seq = last.get("p2p_seq_id" if last.get("is_p2p") else "collective_seq_id", -1)
    group = last.get("process_group") or ("", "")
    name, desc = (list(group) + [""])[:2] if isinstance(group, (list, tuple)) else (str(group), "")
    label = desc if desc and desc != "undefined" else f"group {name}"
    sizes = tuple(tuple(s) for s in last.get("input_sizes") or ())
    return (op, int(seq), sizes, tuple(last.get("input_dtypes") or ()), label, str(last.get("state", "")),
            len(pending))


def _dump_function():
    try:
        import torch._C._distributed_c10d as c10d
    except ImportError:
        return None
    return next((fn for name in DUMPS if (fn := getattr(c10d, name, None)) is not None), None)


def _read(dump, only_active: bool) -> dict:
    raw = dump(includeCollectives=True, onlyActive=only_active)
    return json.loads(raw.decode() if isinstance(raw, bytes) else raw)


def summary(environ: MutableMapping[str, str] = os.environ) -> tuple:
    """This rank's recorder summarised (`summarise`), on nccl once a process group exists; () otherwise,
    or when torch gives no dump, or it fails or takes longer than DUMP_WAIT."""
    if not on_nccl(environ):
        return ()
    import torch.distributed as dist

    dump = _dump_function()
    if dump is None or not dist.is_available() or not dist.is_initialized():
        return ()
    said: list[tuple] = []

    def read() -> None:
        try:
            found = summarise(_read(dump, True))  # the entries not completed: few, fast
            said.append(found or summarise(_read(dump, False)))  # none: the last completed one
        except Exception:  # noqa: BLE001 - a recorder that cannot be read says nothing; the doctor goes on
            said.append(())

    reader = threading.Thread(target=read, name="nbtrain-flight-recorder", daemon=True)
    reader.start()
    reader.join(DUMP_WAIT)
    return said[0] if said else ()
