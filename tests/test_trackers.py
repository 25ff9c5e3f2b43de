"""ctx.log reaches TensorBoard, MLflow and W&B through their own clients, written by the ranks."""
import glob
import os
import re
import sys
import tempfile

import psutil
import pytest

import nbtrain

CPU2 = {"devices": 2, "accelerator": "cpu", "strategy": "ddp_fork", "progress": False, "timeout": 120}
STEPS = 6


@pytest.fixture
def mlflow_client():
    """The test's own MlflowClient for a store, its connections closed before the leftover check
    (asked for after `no_leftovers`, so torn down first): SQLAlchemy keeps the SQLite file open."""
    from mlflow import MlflowClient

    made = []
    yield lambda uri: made.append(MlflowClient(uri)) or made[-1]
    for client in made:
        client._tracking_client.store.engine.dispose()


def train(steps, lr=0.5):
    ctx = nbtrain.context()
    for i in ctx.progress(range(steps)):
        ctx.log("loss", lr / (i + 1) + ctx.rank)  # each rank's own
    ctx.log("score", float(ctx.rank), sync_dist=True)  # the mean over ranks: 0.5
    return ctx.rank


def _tensorboard_of_train(run_dir):
    """What `train` wrote, read back by TensorBoard's own reader: every step, the synced value
    once; the hyper-parameters returned."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    rank0 = EventAccumulator(str(run_dir / "tensorboard"))
    rank0.Reload()
    rank1 = EventAccumulator(str(run_dir / "tensorboard" / "rank1"))
    rank1.Reload()
    assert [e.step for e in rank0.Scalars("loss/rank0")] == list(range(STEPS))
    assert [e.value for e in rank1.Scalars("loss/rank1")] == pytest.approx([0.5 / (i + 1) + 1 for i in range(STEPS)])
    assert [e.value for e in rank0.Scalars("score")] == [0.5]  # synced: written once, by rank 0
    assert "score" not in rank1.Tags()["scalars"] and "loss/rank0" not in rank1.Tags()["scalars"]
    start = HParamsPluginData.FromString(rank0.PluginTagToContent("hparams")["_hparams_/session_start_info"])
    return start.session_start_info.hparams


@pytest.mark.slow
def test_tensorboard_files_read_back_with_every_step(tmp_path, no_leftovers):
    result = nbtrain.launch(train, STEPS, trackers="tensorboard", run_dir=tmp_path, **CPU2)
    assert result.values == [0, 1]
    hparams = _tensorboard_of_train(tmp_path)
    assert (hparams["steps"].number_value, hparams["lr"].number_value) == (STEPS, 0.5)
    assert (hparams["strategy"].string_value, hparams["world_size"].number_value) == ("ddp_fork", 2)


@pytest.mark.slow
def test_mlflow_sqlite_store_has_the_metric_history_and_settings(tmp_path, no_leftovers, mlflow_client):
    uri = f"sqlite:///{tmp_path}/store.db"
    tracker = nbtrain.MLflow(tracking_uri=uri, experiment="insight")
    nbtrain.launch(train, STEPS, trackers=[tracker], run_dir=tmp_path / "run", **CPU2)
    client = mlflow_client(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("insight").experiment_id])
    for rank in (0, 1):
        history = client.get_metric_history(run.info.run_id, f"loss/rank{rank}")
        assert sorted(m.step for m in history) == list(range(STEPS))
    assert [m.value for m in client.get_metric_history(run.info.run_id, "score")] == [0.5]
    params = run.data.params
    assert (params["steps"], params["lr"], params["world_size"], params["strategy"]) == (str(STEPS), "0.5", "2",
                                                                                         "ddp_fork")
    assert run.info.status == "FINISHED"


@pytest.mark.slow
def test_mlflow_honours_the_tracking_uri_of_the_environment(tmp_path, monkeypatch, no_leftovers, mlflow_client):
    uri = f"sqlite:///{tmp_path}/env.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    nbtrain.launch(train, 2, trackers="mlflow", run_dir=tmp_path / "run", **{**CPU2, "devices": 1})
    client = mlflow_client(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("nbtrain").experiment_id])
    assert len(client.get_metric_history(run.info.run_id, "loss")) == 2  # one rank: nothing to tag
    assert not (tmp_path / "run" / "mlflow.db").exists()


@pytest.mark.slow
def test_wandb_offline_writes_each_ranks_run(tmp_path, no_leftovers):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install 'nbtrain[wandb]')")
    temp = set(glob.glob(os.path.join(tempfile.gettempdir(), "*wandb*")))
    nbtrain.launch(train, STEPS, trackers=nbtrain.WandB(project="insight", mode="offline"), run_dir=tmp_path, **CPU2)
    runs = sorted(glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(runs) == 2 and all(os.path.getsize(r) > 0 for r in runs)  # rank 0's, and rank 1's own values
    left = [p.info for p in psutil.process_iter(["pid", "name"]) if p.info["name"] == "wandb-core"]
    assert not left, f"W&B's service left running: {left}"
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "*wandb*"))) == temp  # its temporary folders removed


def test_an_uninstalled_tracker_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as Python sees a package that is not installed
    with pytest.raises(ImportError, match=r"^trackers='mlflow' needs the mlflow package, which is not installed: "
                                          r"pip install 'nbtrain\[mlflow\]'$"):
        nbtrain.launch(train, 1, trackers=["mlflow"], devices=1, accelerator="cpu", progress=False)


@pytest.mark.parametrize("trackers, words", [
    ("tensorbord", "trackers='tensorbord' is not a tracker nbtrain knows. Accepted: 'tensorboard'"),
    (42, "trackers=42 is not a tracker. Accepted:"),
    (["tensorboard", nbtrain.TensorBoard()], "names a tracker twice"),
])
def test_bad_trackers_are_refused_in_one_line(trackers, words, tmp_path):
    with pytest.raises(ValueError, match=re.escape(words)) as caught:
        nbtrain.launch(train, 1, trackers=trackers, run_dir=tmp_path, devices=1, accelerator="cpu", progress=False)
    assert "\n" not in str(caught.value)


@pytest.mark.slow
def test_a_tracker_that_cannot_write_fails_the_run_with_its_reason(tmp_path, no_leftovers):
    (tmp_path / "file").write_text("")  # a log directory "inside" a file: the writer cannot make it
    tracker = nbtrain.TensorBoard(log_dir=str(tmp_path / "file" / "tensorboard"))
    with pytest.raises(nbtrain.WorkerError) as caught:
        nbtrain.launch(train, 2, trackers=tracker, run_dir=tmp_path / "run", **CPU2)
    assert caught.value.rank == 0 and "NotADirectoryError" in str(caught.value), str(caught.value)


@pytest.mark.slow
def test_tensorboard_on_slurm_ranks_reads_back_with_every_step(slurm, tmp_path, no_leftovers):
    """Ranks that SLURM started write the run directory's event files themselves, as local ranks do."""
    result = nbtrain.launch(train, STEPS, devices=2, accelerator="cpu", cluster=nbtrain.Slurm(), trackers="tensorboard",
                            run_dir=tmp_path, progress=False, timeout=150)
    assert result.values == [0, 1]
    hparams = _tensorboard_of_train(tmp_path)
    assert (hparams["steps"].number_value, hparams["world_size"].number_value) == (STEPS, 2)


def test_a_tracked_launch_takes_a_directory_of_its_own_never_a_submits(tmp_path, monkeypatch, no_leftovers):
    import time

    monkeypatch.chdir(tmp_path)
    # What submits of a function of the same name made (this second and the next ones): the
    # launch's default name is the same pattern, so it must take the next free one.
    base, now = tmp_path / "nbtrain-runs", time.time()
    taken = [base / f"{time.strftime('%Y%m%d-%H%M%S', time.localtime(now + s))}-train" for s in range(30)]
    for path in taken:
        path.mkdir(parents=True)
        (path / "status.json").write_text("{}")
    result = nbtrain.launch(train, 2, trackers="tensorboard", devices=1, accelerator="cpu", progress=False)
    assert result.values == [0]
    assert all(sorted(os.listdir(path)) == ["status.json"] for path in taken), "a submit's directory was used"
    [own] = set(base.iterdir()) - set(taken)
    assert re.fullmatch(r"\d{8}-\d{6}-train-2", own.name) and (own / "tensorboard").is_dir(), own
