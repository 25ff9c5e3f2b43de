"""ctx.log reaches TensorBoard, MLflow and W&B through their own clients, written by the ranks."""
import glob
import os
import re
import socket
import sys
import tempfile

import psutil
import pytest

import nbtrain
from conftest import this_workers
from nbtrain.rank.trackers import TrackerError

CPU2 = {"devices": 2, "accelerator": "cpu", "start": "fork", "progress": False, "timeout": 120}
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


def train_seeing_wandb(steps):
    import wandb

    train(steps)
    if nbtrain.context().rank != 0:
        return None  # its writer opens on the trackers' thread, with its first value: not yet, perhaps
    run = nbtrain.context()._trackers.writers["wandb"].run  # rank 0's W&B run, opened as the run started
    assert isinstance(run, wandb.Run)
    # Its system monitor ended before it could remove its socket, as a loaded machine once had it:
    # the rank's W&B end removes what the monitor left.
    monitors = [p for p in psutil.Process().children(recursive=True) if p.name() == "wandb-symon"]
    assert monitors
    for monitor in monitors:
        monitor.kill()
    return run.settings.init_timeout, run.settings.finish_timeout


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
    assert (hparams["strategy"].string_value, hparams["world_size"].number_value) == ("ddp", 2)


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
                                                                                         "ddp")
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
    result = nbtrain.launch(train_seeing_wandb, STEPS, trackers=nbtrain.WandB(project="insight", mode="offline"),
                            run_dir=tmp_path, **CPU2)
    assert result.values == [(30.0, 120.0), None]  # nbtrain's bounds on W&B's start and end (its own: 90 s, none)
    runs = sorted(glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(runs) == 2 and all(os.path.getsize(r) > 0 for r in runs)  # rank 0's, and rank 1's own values
    left = [p.info for p in psutil.process_iter(["pid", "name"]) if p.info["name"] == "wandb-core" and this_workers(p)]
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
    assert caught.value.rank == 0 and str(caught.value).splitlines()[0] == (
        f"rank 0 failed: TrackerError: TensorBoard in {tmp_path / 'file' / 'tensorboard'} could not start: not a "
        f"directory ({tmp_path / 'file' / 'tensorboard'})"), str(caught.value)


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


# -- every wait on a tracker is bounded, and a failure names the tracker and where it writes --

@pytest.fixture
def closed_port():
    """A local port nothing listens on: connections are refused."""
    from nbtrain.placements.base import free_port  # outside the range outgoing connections take ports from

    return free_port()


@pytest.fixture
def silent_port():
    """A local port that accepts connections (the kernel completes them) and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield s.getsockname()[1]


# The launch's own timeout only guards against a hang: a tracker that waited longer than its
# bound would end the launch with "timed out after 90 s" instead of the tracker's error.
BOUNDED = {**CPU2, "timeout": 90}


@pytest.mark.slow
@pytest.mark.parametrize("server, said", [("closed_port", "connection refused"), ("silent_port", "no answer in time")])
def test_an_mlflow_server_that_does_not_answer_fails_the_run_naming_mlflow_and_the_uri(server, said, request,
                                                                                      monkeypatch, tmp_path,
                                                                                      no_leftovers):
    uri = f"http://127.0.0.1:{request.getfixturevalue(server)}"
    # A silent server is waited on for each request's whole timeout: a shorter one of the user's own
    # (nbtrain's 10 s is the refused server's, said below).
    given = "10"
    if server == "silent_port":
        given = "2"
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", given)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")  # the retries at once: nbtrain's 2 s apart are not what is said
    with pytest.raises(nbtrain.WorkerError) as caught:
        nbtrain.launch(train, STEPS, trackers=nbtrain.MLflow(tracking_uri=uri), run_dir=tmp_path, **BOUNDED)
    assert caught.value.rank == 0
    assert str(caught.value).splitlines()[0] == (
        f"rank 0 failed: TrackerError: MLflow at {uri} could not start: {said} (each request given {given} s, "
        "2 retries: MLFLOW_HTTP_REQUEST_TIMEOUT, MLFLOW_HTTP_REQUEST_MAX_RETRIES)")


@pytest.mark.slow
def test_mlflows_http_settings_are_the_runs_only_and_the_users_own_win(closed_port, monkeypatch, tmp_path,
                                                                       no_leftovers):
    uri = f"http://127.0.0.1:{closed_port}"
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    def mlflows():
        return {k: v for k, v in os.environ.items() if k.startswith("MLFLOW_")}

    before = mlflows()
    with pytest.raises(TrackerError) as caught:  # one rank: the run is in this process
        nbtrain.launch(train, 2, trackers=nbtrain.MLflow(tracking_uri=uri), run_dir=tmp_path,
                       **{**BOUNDED, "devices": 1})
    assert str(caught.value).splitlines()[0] == (
        f"rank 0 failed: TrackerError: MLflow at {uri} could not start: connection refused (each request given 10 s, "
        "0 retries: MLFLOW_HTTP_REQUEST_TIMEOUT, MLFLOW_HTTP_REQUEST_MAX_RETRIES)")
    assert mlflows() == before  # nbtrain's settings were for the run: none is left in the kernel


@pytest.mark.slow
@pytest.mark.parametrize("server, said", [("closed_port", "connection refused"), ("silent_port", "no answer in time")])
def test_a_wandb_server_that_does_not_answer_fails_the_run_in_bounded_time(server, said, request, monkeypatch,
                                                                          tmp_path, no_leftovers):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install 'nbtrain[wandb]')")
    url = f"http://127.0.0.1:{request.getfixturevalue(server)}"
    monkeypatch.setenv("WANDB_BASE_URL", url)
    # A bound of the user's own, shorter than nbtrain's 30 s (test_wandb_is_bounded_unless_the_user_says):
    # the run still fails saying why, and its W&B service still ends.
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "4")
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)  # any key: the server is never reached
    # No look-up of the key's account before the run: W&B gives each of its two 5 s of its own.
    monkeypatch.setenv("WANDB_X_DISABLE_VIEWER", "true")
    with pytest.raises(nbtrain.WorkerError) as caught:
        nbtrain.launch(train, STEPS, trackers=nbtrain.WandB(mode="online"), run_dir=tmp_path, **BOUNDED)
    assert f"TrackerError: W&B (online, {url}) in {tmp_path} could not start: {said}" in str(caught.value)
    left = [p.info for p in psutil.process_iter(["pid", "name", "ppid"])
            if p.info["name"] == "wandb-core" and this_workers(p)]
    assert not left, f"W&B's service left running: {left}"


def test_wandb_is_bounded_unless_the_user_says():
    from nbtrain.rank.tracker_writers import wandb_timeouts

    assert wandb_timeouts({}) == {"init_timeout": 30.0, "finish_timeout": 120.0}  # W&B's own: 90 s, and no end
    assert wandb_timeouts({"WANDB_INIT_TIMEOUT": "8"}) == {"finish_timeout": 120.0}  # the user's own wins
    assert wandb_timeouts({"WANDB_INIT_TIMEOUT": "8", "WANDB_FINISH_TIMEOUT": "0"}) == {}


@pytest.mark.slow
def test_tensorboard_on_a_full_disk_fails_the_run_saying_so_and_the_training_ends(small_disk, tmp_path,
                                                                                  no_leftovers):
    disk = small_disk("64k")
    with pytest.raises(nbtrain.WorkerError) as caught:
        nbtrain.launch(train, 5000, trackers=nbtrain.TensorBoard(log_dir=str(disk / "tb")), run_dir=tmp_path / "run",
                       **BOUNDED)
    # Every rank writes its own event file: whichever first meets the full disk is named, rank 0
    # writing its steps or, when rank 0 filled the disk first, another rank opening its file.
    first = str(caught.value).splitlines()[0]
    assert re.search(rf"TrackerError: TensorBoard in {re.escape(str(disk / 'tb'))}\S* could not (write|start): "
                     "no space left on device", first), str(caught.value)


@pytest.mark.parametrize("make, words", [
    (lambda: nbtrain.TensorBoard(log_dir=42), "TensorBoard(log_dir=42): give a directory path (a str or pathlib.Path)"),
    (lambda: nbtrain.TensorBoard(log_dir=""), "TensorBoard(log_dir=''): give a directory path"),
    (lambda: nbtrain.MLflow(tracking_uri=5000), "MLflow(tracking_uri=5000): give a tracking URI such as 'http://"),
    (lambda: nbtrain.MLflow(tracking_uri=" "), "MLflow(tracking_uri=' '): give a tracking URI"),
    (lambda: nbtrain.MLflow(experiment=""), "MLflow(experiment=''): give the experiment's name, a non-empty str."),
    (lambda: nbtrain.MLflow(run_name=3), "MLflow(run_name=3): give a non-empty str, or None"),
    (lambda: nbtrain.WandB(project=None), "WandB(project=None): give the project's name, a non-empty str."),
    (lambda: nbtrain.WandB(mode="offlne"), "WandB(mode='offlne'): give one of 'online', 'offline', 'disabled', 's"),
    (lambda: nbtrain.WandB(entity=""), "WandB(entity=''): give a W&B user or team name, or None"),
    (lambda: nbtrain.WandB(dir=1), "WandB(dir=1): give a directory path"),
])
def test_bad_tracker_settings_are_refused_where_they_are_written(make, words):
    with pytest.raises(ValueError) as caught:
        make()
    assert str(caught.value).startswith(words) and "\n" not in str(caught.value), str(caught.value)
