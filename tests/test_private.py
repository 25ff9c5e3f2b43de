"""common/private.py: whole files or none, private modes, and only our own files read back."""
import os
import pickle
import resource
import stat

import pytest

from nbtrain.common.private import (
    IncompleteWrite,
    NotYours,
    check_own,
    private_dir,
    read_own,
    read_own_json,
    write_private,
)


def test_a_file_is_written_whole_and_private_whatever_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        where = private_dir(tmp_path / "a" / "run")
        write_private(where / "result.pkl", b"x" * 3_000_000)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(where).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(where / "result.pkl").st_mode) == 0o600
    assert read_own(where / "result.pkl") == b"x" * 3_000_000
    assert os.listdir(where) == ["result.pkl"]  # no temporary file left


def test_an_existing_wider_directory_is_made_private(tmp_path):
    (tmp_path / "wide").mkdir(mode=0o755)
    os.chmod(tmp_path / "wide", 0o755)
    private_dir(tmp_path / "wide")
    assert stat.S_IMODE(os.stat(tmp_path / "wide").st_mode) == 0o700
    with pytest.raises(FileExistsError):
        private_dir(tmp_path / "wide", exist_ok=False)


def test_a_write_cut_by_a_file_size_limit_leaves_the_old_file_and_says_how_far(tmp_path):
    target = tmp_path / "result.pkl"
    target.write_bytes(b"old")
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, limits[1]))  # Python ignores SIGXFSZ: writes fail EFBIG
    try:
        with pytest.raises(IncompleteWrite) as said:
            write_private(target, b"y" * 600_000)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    assert str(said.value) == "result.pkl: file too large (wrote 100,000 of 600,000 bytes)"
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["result.pkl"]


def test_an_incomplete_write_pickles_with_its_words(tmp_path):
    error = IncompleteWrite(tmp_path / "status.json", OSError(28, "No space left on device"), 5, 10)
    again = pickle.loads(pickle.dumps(error))
    assert str(again) == str(error) == "status.json: no space left on device (wrote 5 of 10 bytes)"
    assert again.errno == 28 and again.wrote == 5


def test_a_link_is_refused_before_anything_is_read(tmp_path):
    (tmp_path / "real.json").write_text('{"a": 1}')
    (tmp_path / "link.json").symlink_to(tmp_path / "real.json")
    with pytest.raises(NotYours, match="symbolic link"):
        read_own(tmp_path / "link.json")
    (tmp_path / "linked").symlink_to(tmp_path)
    with pytest.raises(NotYours, match="symbolic link"):
        private_dir(tmp_path / "linked")
    assert read_own_json(tmp_path / "real.json") == {"a": 1}


def test_a_damaged_json_file_is_named(tmp_path):
    (tmp_path / "status.json").write_text('{"status": "runn')
    with pytest.raises(ValueError, match=r"status.json' is damaged \(not JSON.*16 bytes, cut or overwritten"):
        read_own_json(tmp_path / "status.json")


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_file_of_another_user_is_refused(tmp_path):
    (tmp_path / "result.pkl").write_bytes(pickle.dumps(1))
    os.chown(tmp_path / "result.pkl", 65534, 65534)  # nobody
    with pytest.raises(NotYours, match="belongs to user 'nobody' \\(uid 65534\\), not to you"):
        read_own(tmp_path / "result.pkl")
    with pytest.raises(NotYours):
        check_own(tmp_path / "result.pkl")


def test_a_file_is_read_from_an_offset_or_its_last_bytes(tmp_path):
    write_private(tmp_path / "events.jsonl", b"0123456789")
    assert read_own(tmp_path / "events.jsonl", 4) == b"456789"
    assert read_own(tmp_path / "events.jsonl", -3) == b"789"
    assert read_own(tmp_path / "events.jsonl", -30) == b"0123456789"
    assert read_own(tmp_path / "events.jsonl", 30) == b""
