import os
import subprocess
import sys

import pytest

from nbtrain.common import inventory
from nbtrain.common.inventory import Gpu, GpuProcess, NvmlInventory, StaticInventory, find_free_gpus, visible_gpus
from nbtrain.display.gpus import gpus

HOLDER = GpuProcess(4242, "python", 3 * 2**30)
SYNTHETIC = StaticInventory([
    Gpu(0, "Tesla T4", "GPU-aaaa", "00000000:17:00.0", 2**30, 15 * 2**30, 37, (HOLDER,)),
    Gpu(1, "Tesla T4", "GPU-bbbb", "00000000:65:00.0", 0, 15 * 2**30, 0),
    Gpu(2, "Tesla T4", "GPU-cccc", "00000000:B1:00.0", 0, 15 * 2**30, 0),
])
PCI = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def test_visible_indices_follow_cuda_visible_devices():
    seen = visible_gpus(SYNTHETIC, {**PCI, "CUDA_VISIBLE_DEVICES": "2,0"})
    assert [(g.index, g.physical_index) for g in seen] == [(0, 2), (1, 0)]


def test_find_free_gpus_uses_visible_indices():
    assert find_free_gpus(2, SYNTHETIC, PCI) == [1, 2]
    assert find_free_gpus(1, SYNTHETIC, {**PCI, "CUDA_VISIBLE_DEVICES": "0,2"}) == [1]
    assert find_free_gpus(None, SYNTHETIC, PCI) == [1, 2]


def test_find_free_gpus_names_the_holders():
    with pytest.raises(RuntimeError) as info:
        find_free_gpus(3, SYNTHETIC, PCI)
    assert "asked for 3 free GPUs, but 2 of 3 visible are free" in str(info.value)
    assert "GPU 0 held by pid 4242 (python, 3.0 GiB)" in str(info.value)
    with pytest.raises(ValueError, match="k must be a positive int"):
        find_free_gpus(0, SYNTHETIC, PCI)
    with pytest.raises(RuntimeError, match="asked for a free GPU, but 0 of 0"):
        find_free_gpus(None, StaticInventory([]), PCI)


def test_table_text_and_html():
    table = gpus(SYNTHETIC)
    text = str(table)
    assert text.splitlines()[0].split()[:3] == ["GPU", "name", "memory"]
    assert "1.0/15.0 GiB" in text and "37%" in text and "4242 python 3.0G" in text
    assert "<table>" in table._repr_html_() and "Tesla T4" in table._repr_html_()
    assert str(gpus(StaticInventory([]))).startswith("no GPU visible:")


def test_use_inventory_injects_and_restores():
    inventory.use_inventory(SYNTHETIC)
    try:
        assert len(gpus()) == 3
    finally:
        inventory.use_inventory(None)
    assert isinstance(inventory._default, NvmlInventory)


def _nvml_gpu_count() -> int:
    return len(NvmlInventory().physical_gpus())


@pytest.mark.slow
@pytest.mark.skipif(_nvml_gpu_count() > 0, reason="a GPU driver is present here; this test covers machines without one")
def test_nvml_without_driver_is_quiet_and_empty():
    out = subprocess.run([sys.executable, "-W", "default", "-c", "import nbtrain; print(len(nbtrain.gpus()))"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0" and out.stderr == ""


@pytest.mark.gpu
@pytest.mark.skipif(_nvml_gpu_count() == 0, reason="needs an NVIDIA GPU and driver (NVML); none here")
def test_nvml_reads_real_gpus():
    found = gpus()
    assert found and found[0].memory_total > 0 and found[0].uuid.startswith(("GPU-", "MIG-"))
    assert found[0].name
    print(found)


@pytest.mark.slow
def test_cli_gpus_prints_table_or_cpu_line():
    out = subprocess.run([sys.executable, "-m", "nbtrain.cli", "gpus"], capture_output=True, text=True, check=True)
    expected = "GPU" if _nvml_gpu_count() else f"no GPU visible: {os.cpu_count()} CPU cores"
    assert expected in out.stdout


def test_the_inventory_renders_nothing_the_display_layer_shows_it():
    # Layering reads one way: display -> inventory. The inventory imports no display code.
    import ast

    import nbtrain
    from nbtrain.display.gpus import GpuTable

    tree = ast.parse(open(inventory.__file__).read())
    imported = [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    imported += [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    assert not [name for name in imported if "display" in name]
    assert not hasattr(inventory, "gpus")
    assert isinstance(nbtrain.gpus(SYNTHETIC), GpuTable)
