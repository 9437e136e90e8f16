"""The persistent state directory: durable, atomic records that are never followed."""

from __future__ import annotations

import os

import pytest

from reconciler.domain.errors import PreconditionError
from reconciler.drivers import statedir


def test_records_round_trip_and_leave_no_temporaries(tmp_path: os.PathLike[str]) -> None:
    d = statedir.scope_dir("netns/sbx-1", root=str(tmp_path / "state"))
    assert d.endswith("/state/netns-sbx-1")
    assert oct(os.stat(d).st_mode & 0o777) == "0o700"
    assert statedir.read_record(d, "pending.json") is None
    statedir.write_record(d, "pending.json", {"deadline": 1.5, "ops": [1, 2]})
    statedir.write_record(d, "pending.json", {"deadline": 2.5})
    assert statedir.read_record(d, "pending.json") == {"deadline": 2.5}
    assert statedir.list_records(d) == ["pending.json"]
    assert oct(os.stat(os.path.join(d, "pending.json")).st_mode & 0o777) == "0o600"
    assert statedir.remove_record(d, "pending.json") is True
    assert statedir.remove_record(d, "pending.json") is False


def test_a_planted_symlink_is_refused(tmp_path: os.PathLike[str]) -> None:
    d = statedir.scope_dir("host", root=str(tmp_path))
    os.symlink("/etc/passwd", os.path.join(d, "journal.json"))
    with pytest.raises(PreconditionError, match="symlink"):
        statedir.read_record(d, "journal.json")
    before = os.stat("/etc/passwd")
    statedir.write_record(d, "journal.json", {"a": 1})  # replaces the link, not its target
    assert not os.path.islink(os.path.join(d, "journal.json"))
    assert os.stat("/etc/passwd").st_mtime_ns == before.st_mtime_ns
    os.symlink("/etc/passwd", os.path.join(d, f".journal.json.{os.getpid()}.tmp"))
    with pytest.raises(OSError):  # nor is a link planted at the temporary name followed
        statedir.write_record(d, "journal.json", {"a": 2})
    assert statedir.read_record(d, "journal.json") == {"a": 1}


def test_a_group_writable_directory_is_refused(tmp_path: os.PathLike[str]) -> None:
    root = str(tmp_path / "state")
    statedir.scope_dir("host", root=root)
    os.chmod(root, 0o777)
    with pytest.raises(PreconditionError, match="writable by group or others"):
        statedir.scope_dir("host", root=root)


def test_garbage_in_a_record_is_one_clear_error(tmp_path: os.PathLike[str]) -> None:
    d = statedir.scope_dir("host", root=str(tmp_path))
    with open(os.path.join(d, "pending.json"), "w") as fh:
        fh.write("{half")
    with pytest.raises(PreconditionError, match="not a record the reconciler wrote"):
        statedir.read_record(d, "pending.json")


@pytest.mark.parametrize("bad", ["", "a/b", ".hidden", "x\0y"])
def test_record_names_stay_in_the_directory(tmp_path: os.PathLike[str], bad: str) -> None:
    with pytest.raises(ValueError):
        statedir.write_record(str(tmp_path), bad, {})


def test_boot_id_is_read() -> None:
    assert len(statedir.boot_id()) == 36
