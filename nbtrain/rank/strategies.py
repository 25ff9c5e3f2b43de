"""How `ctx.setup` wraps a module for the run's strategy: none, DataParallel, DDP, FSDP2, or left to DeepSpeed.

One place decides, whatever started the ranks (fork, spawn, torchrun, live ranks): the
strategy reaches a rank as `NBTRAIN_STRATEGY` and the Context asks `wrap` here.

FSDP2 (`torch.distributed.fsdp.fully_shard`) shards every parameter on dim 0 across the
ranks. Which submodules become their own unit decides how much is gathered at a time, not
how much each rank holds: a unit's full parameters exist only while it runs. By default a
unit is every module whose parameters not already in a smaller unit number at least
`min_params` (DEFAULT_MIN_PARAMS, 1M: 4 MB of fp32 weights, large enough that each gather is
not dominated by latency, small enough that a transformer block of any model worth sharding
is its own unit); `shard=(Block,)` names the classes instead. The root is always a unit.
"""
from __future__ import annotations

import copy
import sys
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

DDP_STRATEGIES = ("ddp_fork", "ddp_spawn", "ddp")
SHARDED_STRATEGIES = ("fsdp", "deepspeed")
DEFAULT_MIN_PARAMS = 1_000_000
PRECISIONS = {"bf16": torch.bfloat16, "bf16-mixed": torch.bfloat16, "fp16": torch.float16, "16-mixed": torch.float16}
_ACCEPTED_PRECISION = "None (full precision), 'bf16' ('bf16-mixed'), 'fp16' ('16-mixed'), or a MixedPrecisionPolicy"

# Each sharded module's plain twin on the meta device, taken just before sharding: what
# `prepare_return` fills with the gathered weights (FSDP modules cannot be deep-copied).
_skeletons: weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class ShardOptions:
    """`ctx.setup`'s FSDP options, checked. Accepted under every strategy (so one training
    function runs under ddp and fsdp alike); only fsdp acts on them."""

    shard: tuple[type, ...] | None = None
    min_params: int = DEFAULT_MIN_PARAMS
    mixed_precision: Any = None  # a MixedPrecisionPolicy, or None
    cpu_offload: Any = False  # a CPUOffloadPolicy, or False
    reshard_after_forward: bool = True

    @classmethod
    def check(cls, shard=None, min_params=DEFAULT_MIN_PARAMS, mixed_precision=None, cpu_offload=False,
              reshard_after_forward=True) -> ShardOptions:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        if shard is not None:
            classes = tuple(shard) if isinstance(shard, (tuple, list, set, frozenset)) else (shard,)
            if not classes or not all(isinstance(c, type) and issubclass(c, torch.nn.Module) for c in classes):
                raise ValueError(f"shard={shard!r}: give the nn.Module classes to shard one unit each, e.g. "
                                 f"shard=(Block,), or None to shard each submodule with at least min_params "
                                 f"parameters ({DEFAULT_MIN_PARAMS:,} unless given).")
            shard = classes
        if isinstance(min_params, bool) or not isinstance(min_params, int) or min_params < 1:
            raise ValueError(f"min_params={min_params!r}: give an int >= 1, the fewest parameters a submodule needs "
                             f"to be sharded as a unit of its own (default {DEFAULT_MIN_PARAMS:,}).")
        if isinstance(mixed_precision, str) and mixed_precision in PRECISIONS:
            mixed_precision = MixedPrecisionPolicy(param_dtype=PRECISIONS[mixed_precision], reduce_dtype=torch.float32)
        elif mixed_precision in ("32", "32-true"):
            mixed_precision = None
        elif mixed_precision is not None and not isinstance(mixed_precision, MixedPrecisionPolicy):
            raise ValueError(f"mixed_precision={mixed_precision!r} is not known. Accepted: {_ACCEPTED_PRECISION}.")
        if cpu_offload is True:
            cpu_offload = CPUOffloadPolicy()
        elif cpu_offload is not False and not isinstance(cpu_offload, CPUOffloadPolicy):
            raise ValueError(f"cpu_offload={cpu_offload!r}: give True (parameters, gradients and optimizer state "
                             "kept on the CPU between uses), False, or a CPUOffloadPolicy.")
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward={reshard_after_forward!r}: give True (free gathered parameters "
                             "after forward, as FULL_SHARD) or False (keep them until backward, as SHARD_GRAD_OP).")
        return cls(shard, min_params, mixed_precision, cpu_offload, reshard_after_forward)


def wrap(module: torch.nn.Module, ctx, options: ShardOptions) -> torch.nn.Module:
    """`module` ready for this rank's strategy: sharded (fsdp), DataParallel, DDP or as is."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"ctx.setup(module) needs a torch.nn.Module, got {type(module).__name__}.")
    if ctx.strategy == "fsdp":
        return shard(module, ctx, options)
    if ctx.strategy == "deepspeed":
        # deepspeed.initialize(model=..., config=...) shards it (ZeRO); remembered here so
        # that a returned engine comes back as a plain module.
        _remember_skeleton(module)
        return module.to(ctx.device)
    module = module.to(ctx.device)
    if ctx._dp_device_ids:
        return torch.nn.DataParallel(module, device_ids=list(ctx._dp_device_ids))
    if ctx.is_distributed:
        ctx._ensure_group()
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        # Gradients as views into the all-reduce buckets: DDP then copies no gradient into a
        # bucket and back each step, which is most of what it costs on one rank and a share of
        # it on several (benchmarks/ddp_one_rank.py). The one thing it forbids, detaching a
        # gradient in place, training code does not do.
        return torch.nn.parallel.DistributedDataParallel(module, device_ids=device_ids, gradient_as_bucket_view=True)
    return module


# -- fsdp -------------------------------------------------------------------------------------

def shard(module: torch.nn.Module, ctx, options: ShardOptions) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, OffloadPolicy, fully_shard

    if isinstance(module, FSDPModule):
        raise ValueError("ctx.setup(module): this module is already sharded (fully_shard was applied to it); "
                         "pass the plain module, once.")
    ctx._ensure_group()
    # FSDP2 shards whatever each rank holds; DDP would have broadcast rank 0's weights, and
    # users expect the same here: one model, whatever each rank's seed made of it.
    broadcast_from_rank0(module, ctx)
    _remember_skeleton(module)
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    # On a CPU run the parameters already live where offloading would put them.
    offload = options.cpu_offload if options.cpu_offload and ctx.device.type != "cpu" else OffloadPolicy()
    settings: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": options.reshard_after_forward,
                                "offload_policy": offload}
    if options.mixed_precision is not None:
        settings["mp_policy"] = options.mixed_precision
    for unit in units(module, options):
        fully_shard(unit, **settings)
    # None: FSDP2 keeps the root gathered after forward (backward starts with it) under
    # full sharding; False (keep everything gathered) is kept as asked.
    settings["reshard_after_forward"] = None if options.reshard_after_forward else False
    return fully_shard(module, **settings)  # type: ignore[return-value]  # the module itself, now also an FSDPModule


def units(module: torch.nn.Module, options: ShardOptions) -> list[torch.nn.Module]:
    """Submodules to shard as units of their own, innermost first (fully_shard goes bottom-up).

    A module sharing a parameter with one outside it (tied embeddings) is left to the unit
    around both: FSDP2 refuses a tied parameter split between units.
    """
    contained = _self_contained(module)
    if options.shard is not None:
        return [m for m in _post_order(module) if m is not module and isinstance(m, options.shard) and contained(m)]
    chosen: list[torch.nn.Module] = []
    pending: dict[int, int] = {}  # pending: parameters of a module not yet in a chosen unit
    for m in _post_order(module):
        count = sum(p.numel() for p in m.parameters(recurse=False))
        count += sum(pending.pop(id(child), 0) for child in m.children())
        if m is not module and count >= options.min_params and contained(m):
            chosen.append(m)
            count = 0
        pending[id(m)] = count
    return chosen


def _registrations(module: torch.nn.Module) -> Counter:
    return Counter(id(p) for m in module.modules()
                   for _, p in m.named_parameters(recurse=False, remove_duplicate=False))


def _self_contained(root: torch.nn.Module):
    everywhere = _registrations(root)

    def contained(m: torch.nn.Module) -> bool:
        return all(everywhere[key] == n for key, n in _registrations(m).items())

    return contained


def _post_order(module: torch.nn.Module, seen=None) -> list[torch.nn.Module]:
    seen = set() if seen is None else seen
    order = []
    for child in module.children():
        if id(child) not in seen:
            seen.add(id(child))
            order += _post_order(child, seen)
    return order + [module]


def broadcast_from_rank0(module: torch.nn.Module, ctx) -> None:
    import torch.distributed as dist

    if ctx.world_size == 1:
        return
    comm = ctx._comm_device
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.is_meta:
                continue
            in_place = tensor.device == comm and tensor.is_contiguous()
            carrier = tensor.detach() if in_place else tensor.detach().to(comm).contiguous()
            dist.broadcast(carrier, src=0)
            if not in_place:
                tensor.copy_(carrier)


def _remember_skeleton(module: torch.nn.Module) -> None:
    # Tensors become meta placeholders in the copy: it costs no memory, and the module's
    # structure, class and attributes are what the gathered weights are loaded into.
    memo: dict[int, torch.Tensor] = {}
    for p in module.parameters():
        memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    skeleton = copy.deepcopy(module, memo)
    twins = dict(skeleton.named_modules(remove_duplicate=False))
    for name, m in module.named_modules(remove_duplicate=False):
        _skeletons[m] = twins[name]


# -- returning sharded modules ----------------------------------------------------------------

def is_sharded(module: torch.nn.Module) -> bool:
    """Parameters held in parts across ranks: FSDP2's DTensors, or DeepSpeed ZeRO-3's partitions."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) or hasattr(p, "ds_id") for p in module.parameters())


def _engine_module(value):
    """A DeepSpeed engine's model (DeepSpeed itself is imported only where it is used)."""
    deepspeed = sys.modules.get("deepspeed")
    if deepspeed is not None and isinstance(value, deepspeed.DeepSpeedEngine):
        return value.module
    return None


def contains_sharded(value) -> bool:
    """Whether `value` holds a sharded module (through modules, lists, tuples and dicts)."""
    found: list = []
    _find_sharded(value, found)
    return bool(found)


def _find_sharded(value, found: list) -> None:
    if _engine_module(value) is not None or (isinstance(value, torch.nn.Module) and is_sharded(value)):
        if all(value is not f for f in found):
            found.append(value)
    elif type(value) is dict:
        for v in value.values():
            _find_sharded(v, found)
    elif type(value) in (list, tuple):
        for v in value:
            _find_sharded(v, found)


def _replace(value, done: dict):
    if id(value) in done:
        return done[id(value)]
    if type(value) is dict:
        return {k: _replace(v, done) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_replace(v, done) for v in value)
    return value


def gather_returned(value, ctx):
    """Sharded modules (and DeepSpeed engines) in a rank's return value, gathered whole to CPU
    on rank 0 (None elsewhere: one copy of the model comes home, not one per rank).
    Collective: every rank must return its sharded modules, as each holds a part of them."""
    found: list = []
    _find_sharded(value, found)
    if ctx.world_size > 1:
        counts = ctx.all_gather(len(found))
        if len(set(counts)) > 1:
            listed = ", ".join(f"rank {r}: {n}" for r, n in enumerate(counts))
            raise RuntimeError(f"every rank must return the sharded model, as each holds a part of it; the "
                               f"numbers of sharded modules returned differ ({listed}). Return the model on every "
                               f"rank; under {ctx.strategy}, only rank 0's copy comes back (whole), the others as "
                               "None.")
    modules = {id(f): _engine_module(f) or f for f in found}
    done = {}
    for top in [f for f in found if not any(o is not f and _contains(modules[id(o)], modules[id(f)]) for o in found)]:
        module = modules[id(top)]
        full = _full_state(module, ctx)
        plain = _plain_module(module, full) if ctx.is_global_zero else None
        done[id(top)] = plain
        # A returned part of a returned model comes back as that part of its plain copy.
        for name, sub in module.named_modules(remove_duplicate=False):
            for f in found:
                if modules[id(f)] is sub and f is not top:
                    done[id(f)] = plain.get_submodule(name) if isinstance(plain, torch.nn.Module) else None
    return _replace(value, done)


def _full_state(module: torch.nn.Module, ctx) -> dict:
    """The module's whole state dict, on CPU, on rank 0 only (an empty dict elsewhere)."""
    if ctx.strategy != "deepspeed":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    import deepspeed

    full = {}
    # ZeRO-3 partitions: gathered one module at a time, so only one module is ever whole.
    for prefix, sub in module.named_modules():
        params = list(sub.named_parameters(recurse=False))
        with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
            if ctx.is_global_zero:
                for name, p in [*params, *sub.named_buffers(recurse=False)]:
                    full[f"{prefix}.{name}" if prefix else name] = p.detach().cpu().clone()
    return full


def _contains(outer: torch.nn.Module, inner: torch.nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def _plain_module(module: torch.nn.Module, full: dict):
    skeleton = _skeletons.get(module)
    if skeleton is None:
        # Sharded by the user's own code, not ctx.setup: no plain twin to fill, but the weights still count.
        print(f"nbtrain: a {type(module).__name__} sharded outside ctx.setup comes back as its full state dict "
              "(load it into a fresh instance with load_state_dict).", file=sys.stderr, flush=True)
        return full
    plain = copy.deepcopy(skeleton)  # meta tensors: nothing is copied
    names: dict[int, list[str]] = {}
    for name, p in plain.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    plain.load_state_dict(full, assign=True, strict=False)
    for first, *tied in (group for group in names.values() if len(group) > 1):  # assign=True unties them
        for name in tied:
            owner, _, leaf = name.rpartition(".")
            setattr(plain.get_submodule(owner), leaf, plain.get_parameter(first))
    owners = dict(plain.named_modules(remove_duplicate=False))
    for name, buffer in module.named_buffers(remove_duplicate=False):  # non-persistent ones are not in `full`
        owner, _, leaf = name.rpartition(".")
        if owners[owner]._buffers.get(leaf) is not None and owners[owner]._buffers[leaf].is_meta:
            owners[owner]._buffers[leaf] = buffer.detach().cpu()
    missing = [n for n, t in [*plain.named_parameters(), *plain.named_buffers()] if t.is_meta]
    if missing:
        raise RuntimeError(f"the gathered state of the returned {type(module).__name__} lacks {', '.join(missing)}.")
    return plain
