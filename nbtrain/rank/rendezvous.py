"""env:// in ranks on the notebook's machine: the launch's private file store, not a TCP port.

torch's env:// rendezvous (what `init_process_group()` uses unless told otherwise: user code,
Lightning, Accelerate, Transformers, DeepSpeed and nbtrain's own Context) joins a TCP store at
MASTER_ADDR:MASTER_PORT, which every account on the machine can connect to and write keys the
ranks read (their peers' addresses among them). Ranks that share the notebook's machine are given
`NBTRAIN_STORE`, a directory only this user can enter (`placements.base.PrivateStore`); env://
opens a torch FileStore there instead, one file per restart attempt (a restarted torchrun rank
must not read the keys of the attempt that failed). torch looks the handler up in its registry
at every call, so this covers `init_process_group` however it was imported. Ranks spread over
several machines keep torch's own store (the README's Security section says what it exposes).
"""
from __future__ import annotations

import os
import sys
from urllib.parse import parse_qsl, urlparse

import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

STORE_VAR = "NBTRAIN_STORE"  # the launch's private directory, for ranks on the notebook's machine


def use_private_store() -> None:
    """Point env:// at this launch's private store, where there is one."""
    directory = os.environ.get(STORE_VAR)
    if not directory:
        return
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    path = os.path.join(directory, f"attempt-{attempt}")
    registry = sys.modules["torch.distributed.rendezvous"]._rendezvous_handlers  # register_ refuses a replacement

    def private_env(url: str, timeout=default_pg_timeout, **kwargs):
        # Rank and world size as torch's env:// takes them: from the call, else the environment.
        query = dict(parse_qsl(urlparse(url).query))
        rank = int(query.get("rank", os.environ["RANK"]))
        world_size = int(query.get("world_size", os.environ["WORLD_SIZE"]))
        store = dist.FileStore(path, -1)  # -1: never removes the file itself; the launch removes the directory
        store.set_timeout(timeout)
        yield store, rank, world_size
        raise RuntimeError("Unable to perform re-rendezvous using env:// method")  # as torch's own handler says

    registry["env"] = private_env
