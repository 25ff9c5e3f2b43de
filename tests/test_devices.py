import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nbtrain.common.devices import DevicePlan, ensure_pci_bus_order, parse_cpu_devices, parse_devices, plan_devices
from nbtrain.common.inventory import Gpu, GpuProcess, StaticInventory

# Lightning's table (docs "GPU training (Basic)", devices column), with 4 visible GPUs.
LIGHTNING_TABLE = [
    (3, [0, 1, 2]),
    (-1, [0, 1, 2, 3]),
    ("-1", [0, 1, 2, 3]),
    ([1, 3], [1, 3]),
    ((1, 3), [1, 3]),
    ("1, 3", [1, 3]),
    ("1,3", [1, 3]),
    ("3", [0, 1, 2]),
    ([3, 1], [3, 1]),
    ([0], [0]),
    ("0,", [0]),
    (" 2 ", [0, 1]),
]


@pytest.mark.parametrize("devices, expected", LIGHTNING_TABLE)
def test_lightning_grammar(devices, expected):
    assert parse_devices(devices, 4) == expected


REFUSED = [
    ([0, 0], ValueError, "more than once"),
    ([4], ValueError, "not visible"),
    ([-1], ValueError, "not visible"),
    (-2, ValueError, "positive"),
    (0, ValueError, "positive"),
    ("0", ValueError, "positive"),
    (5, ValueError, "asked for 5 GPUs but 4 are visible"),
    ("1, x", ValueError, "comma-separated"),
    ("abc", ValueError, "not an integer"),
    ("", ValueError, "not an integer"),
    ([], ValueError, "empty"),
    (True, TypeError, "bool"),
    (2.0, TypeError, "float"),
    (None, TypeError, "NoneType"),
    ([1, "2"], TypeError, "'2' is not an integer"),
    ([1.0], TypeError, "not an integer"),
]


@pytest.mark.parametrize("devices, exc, words", REFUSED)
def test_refusals_quote_input_and_list_accepted_forms(devices, exc, words):
    with pytest.raises(exc) as info:
        parse_devices(devices, 4)
    message = str(info.value)
    assert f"devices={devices!r}" in message
    assert words in message
    assert "Accepted:" in message


def test_no_gpu_visible():
    with pytest.raises(ValueError, match="no GPU is visible"):
        parse_devices(-1, 0)
    with pytest.raises(ValueError, match="no GPU is visible"):
        parse_devices(1, 0)


junk = st.one_of(
    st.integers(-10, 10),
    st.text(max_size=8),
    st.lists(st.one_of(st.integers(-3, 8), st.text(max_size=2), st.booleans()), max_size=5),
    st.floats(allow_nan=True),
    st.none(),
    st.booleans(),
)


@settings(max_examples=400, deadline=None)
@given(devices=junk, available=st.integers(0, 8))
def test_only_value_or_type_errors_come_out(devices, available):
    try:
        result = parse_devices(devices, available)
    except (ValueError, TypeError):
        return
    assert result and all(0 <= i < available for i in result)
    assert len(set(result)) == len(result)


def test_cpu_counts():
    assert parse_cpu_devices(3, 2) == 3
    assert parse_cpu_devices("2", 2) == 2
    assert parse_cpu_devices(-1, 6) == 6
    assert parse_cpu_devices("-1", 6) == 6
    assert parse_cpu_devices("auto", 6) == 1
    with pytest.raises(ValueError, match="positive"):
        parse_cpu_devices(0, 2)
    with pytest.raises(TypeError, match="number of ranks"):
        parse_cpu_devices([0, 1], 2)


def gpu(i, bus, cc=(8, 0), memory=16, procs=()):
    return Gpu(physical_index=i, name=f"Test GPU {i}", uuid=f"GPU-{i:04d}aaaa-{bus}", pci_bus_id=f"00000000:{bus}:00.0",
               memory_total=memory * 2**30, compute_capability=cc, processes=tuple(procs))


FOUR = StaticInventory([gpu(0, "17"), gpu(1, "65"), gpu(2, "B1", cc=(9, 0)), gpu(3, "CA")])


def test_auto_is_gpu_when_visible_else_cpu():
    env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    plan = plan_devices(inventory=FOUR, environ=env)
    assert plan == DevicePlan("gpu", (0, 1, 2, 3), (0, 1, 2, 3), "nccl")
    plan = plan_devices(2, inventory=StaticInventory([]), environ=env)
    assert plan == DevicePlan("cpu", (0, 1), (), "gloo")
    assert plan_devices(inventory=StaticInventory([]), environ=env).nprocs == 1


def test_cuda_visible_devices_maps_positions_to_physical():
    env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "3,1"}
    plan = plan_devices([1], accelerator="gpu", inventory=FOUR, environ=env)
    assert plan.indices == (1,) and plan.physical == (1,)
    plan = plan_devices(-1, accelerator="gpu", inventory=FOUR, environ=env)
    assert plan.physical == (3, 1) and plan.cuda_visible_devices == "3,1"
    with pytest.raises(ValueError, match=r"GPU 2 is not visible \(2 are visible \(0-1\)\)"):
        plan_devices("0,2", accelerator="gpu", inventory=FOUR, environ=env)


def test_cuda_visible_devices_by_uuid_and_truncation():
    env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "GPU-0002,0,9,1"}
    plan = plan_devices(-1, accelerator="gpu", inventory=FOUR, environ=env)
    assert plan.physical == (2, 0)  # CUDA stops at the first invalid entry (9)


def test_fastest_first_order():
    env = {"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}
    plan = plan_devices(-1, accelerator="gpu", inventory=FOUR, environ=env)
    assert plan.physical[0] == 2  # the compute capability 9.0 card leads
    env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert plan_devices(-1, accelerator="gpu", inventory=FOUR, environ=env).physical == (0, 1, 2, 3)


def test_empty_visibility_means_no_gpu():
    env = {"CUDA_VISIBLE_DEVICES": ""}
    assert plan_devices(inventory=FOUR, environ=env).accelerator == "cpu"
    with pytest.raises(RuntimeError, match="no GPU is visible \\(CUDA_VISIBLE_DEVICES=''\\)"):
        plan_devices(1, accelerator="gpu", inventory=FOUR, environ=env)


def test_free_selection_skips_occupied():
    busy = StaticInventory([gpu(0, "17", procs=[GpuProcess(4242, "python", 2**31)]), gpu(1, "65"), gpu(2, "B1")])
    env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert plan_devices("free:2", inventory=busy, environ=env).indices == (1, 2)
    assert plan_devices("free", inventory=busy, environ=env).indices == (1, 2)
    with pytest.raises(RuntimeError, match=r"asked for 3 free GPUs, but 2 of 3 visible are free. Busy: GPU 0 held by pid 4242 \(python, 2.0 GiB\)"):
        plan_devices("free:3", inventory=busy, environ=env)
    with pytest.raises(ValueError, match="'free:N' needs an integer N"):
        plan_devices("free:x", inventory=busy, environ=env)


def test_backend_choice_and_override():
    none = StaticInventory([])
    assert plan_devices(2, inventory=none, environ={}).backend == "gloo"
    assert plan_devices(1, accelerator="gpu", inventory=FOUR, environ={}).backend == "nccl"
    assert plan_devices(1, accelerator="gpu", backend="gloo", inventory=FOUR, environ={}).backend == "gloo"
    with pytest.raises(ValueError, match="backend='nccl' needs GPUs"):
        plan_devices(2, accelerator="cpu", backend="nccl", inventory=none, environ={})
    with pytest.raises(ValueError, match="backend='tcp' is not known. Accepted: nccl, gloo"):
        plan_devices(2, accelerator="cpu", backend="tcp", inventory=none, environ={})


def test_bad_accelerator_and_nodes():
    with pytest.raises(ValueError, match="accelerator='tpu' is not known. Accepted: 'gpu'"):
        plan_devices(1, accelerator="tpu")
    with pytest.raises(ValueError, match="num_nodes=0"):
        plan_devices(1, accelerator="cpu", num_nodes=0)
    plan = plan_devices(2, accelerator="cpu", num_nodes=3)
    assert plan.world_size == 6 and plan.nprocs == 2


def test_picker_like_objects_stand_for_their_selection():
    class Picker:
        devices = [2, 0]

    env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert plan_devices(Picker(), inventory=FOUR, environ=env).indices == (2, 0)


def test_pci_bus_order_is_set_only_when_unset():
    env = {}
    ensure_pci_bus_order(env)
    assert env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    env = {"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}
    ensure_pci_bus_order(env)
    assert env["CUDA_DEVICE_ORDER"] == "FASTEST_FIRST"


def test_cpu_rank_count_is_limited_per_machine():
    plan = plan_devices(16, accelerator="cpu", environ={})
    assert plan.nprocs == 16  # at the floor, whatever the cores
    with pytest.raises(ValueError, match="set NBTRAIN_MAX_CPU_RANKS=100000"):
        plan_devices(100000, accelerator="cpu", environ={})
    assert plan_devices(40, accelerator="cpu", environ={"NBTRAIN_MAX_CPU_RANKS": "40"}).nprocs == 40
