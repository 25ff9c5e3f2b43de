"""What a kernel's first start of ranks pays: torch._dynamo (~800 modules, ~1-2 s) is imported in
the kernel before forking only for ranks that need it, named by the launch's code (here) or learnt
from ranks of this kernel that imported it (tests/test_ranks.py, in a real kernel)."""
import dataclasses
import functools

import torch
import torch.distributed as dist

import nbtrain
from nbtrain.placements.warm import names_dynamo_users


def joins():
    dist.barrier()
    return dist.get_rank()


def makes_an_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def trains_through_a_helper():
    model = torch.nn.Linear(2, 2)
    return makes_an_optimizer(model)


def wraps_with_setup():
    return nbtrain.context().setup(torch.nn.Linear(2, 2))


@dataclasses.dataclass
class Spec:  # as nbtrain's sweep and map hold the user's function (TrialSpec, WorkSpec)
    fn: object
    number: int


def run_spec(spec):
    return spec.fn()


class Model:
    def configure_optimizers(self):
        from torch.optim import Adam

        return Adam([])

    def fit(self):
        return self.configure_optimizers()


def test_a_launch_warms_the_kernel_only_for_code_that_needs_torch_dynamo():
    # Code that never trains: nothing to warm, however it is wrapped.
    assert not names_dynamo_users(joins)
    assert not names_dynamo_users(lambda: 1, (), {})
    assert not names_dynamo_users(functools.partial(run_spec, Spec(joins, 1)))
    # An optimizer, a wrapped model, a trainer: named in the function, a helper it calls, a closure,
    # a partial holding a field, a method of the user's class, or the launch's arguments.
    assert names_dynamo_users(makes_an_optimizer)
    assert names_dynamo_users(trains_through_a_helper)
    assert names_dynamo_users(wraps_with_setup)
    helper = trains_through_a_helper
    assert names_dynamo_users(lambda: helper())
    assert names_dynamo_users(functools.partial(run_spec, Spec(trains_through_a_helper, 1)))
    assert names_dynamo_users(Model().fit)
    assert names_dynamo_users(run_spec, (Spec(wraps_with_setup, 2),), {})
    # More to read than the bound: warmed, as every launch was before.
    assert names_dynamo_users(joins, limit=0)

