"""A full disk while a checkpoint is written: one paragraph naming the
disk and the room needed (DiskFull, exit 2 in train.py), the temporary folder removed, the
previous checkpoints intact; a free-space check before a save; metrics.jsonl rewritten in
place when the disk has no room for a copy."""

import errno
import json
import os
import shutil
import subprocess
import uuid
from collections import namedtuple

import pytest
import torch

from infclip.train import checkpoint as ckpt

Usage = namedtuple("Usage", "total used free")


def _state(step, n=4096):
    return {"w": torch.full((n,), float(step))}


def _save(c, step, n=4096):
    return c.save(step, _state(step, n), {"step": step}, {"rng": ckpt.rng_state(), "data": {}})


def _two_checkpoints(root):
    c = ckpt.Checkpointer(root, keep_last=2, rank=0, barrier=lambda: None)
    _save(c, 1)
    _save(c, 2)
    return c


def _intact(root):
    return {p.name: ckpt.verify_checkpoint(p, 1) for p in ckpt.list_checkpoints(root)}


def _full_after(limit):
    """A writer like checkpoint._save that raises ENOSPC after ``limit`` bytes of a file."""
    def save(obj, path):
        with open(path, "wb") as f:
            f.write(b"\0" * limit)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return save


def _check_refusal(err, root):
    text = str(err)
    assert f"on the disk holding {root / 'checkpoints'}" in text and "mount point /" in text
    assert "checkpoint.keep_last + 1 = 3" in text and "MB" in text and "\n" not in text
    assert not list((root / "checkpoints").glob(".step_*"))  # the temporary folder is gone
    assert _intact(root) == {"step_00000001": None, "step_00000002": None}


def test_enospc_mid_write_removes_the_temp_folder_and_keeps_the_previous(tmp_path, monkeypatch):
    c = _two_checkpoints(tmp_path)
    monkeypatch.setattr(ckpt, "_save", _full_after(1000))
    with pytest.raises(ckpt.DiskFull) as err:
        _save(c, 3)
    assert "the write failed" in str(err.value)
    _check_refusal(err.value, tmp_path)


def test_torchs_short_write_error_on_a_full_disk_is_disk_full(tmp_path, monkeypatch):
    """torch's zip writer reports a failed write as 'unexpected pos', not as ENOSPC."""
    c = _two_checkpoints(tmp_path)

    def short_write(obj, path):
        path.write_bytes(b"\0" * 100)
        raise RuntimeError("[enforce fail at inline_container.cc:778] . unexpected pos 1280 vs 1174")

    monkeypatch.setattr(ckpt, "_save", short_write)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: Usage(10 * 2**20, 10 * 2**20 - 100, 100))
    c._check_room = lambda name, need: None  # the pre-check would refuse first: test the write path
    with pytest.raises(ckpt.DiskFull) as err:
        _save(c, 3)
    _check_refusal(err.value, tmp_path)


def test_the_free_space_is_checked_before_anything_is_written(tmp_path, monkeypatch):
    c = _two_checkpoints(tmp_path)
    need = sum(f.stat().st_size for f in (tmp_path / "checkpoints" / "step_00000002").iterdir())
    writes = []
    monkeypatch.setattr(ckpt, "_save", lambda obj, path: writes.append(path))
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: Usage(2**30, 2**30 - need + 1, need - 1))
    with pytest.raises(ckpt.DiskFull, match="not enough free space to start it") as err:
        _save(c, 3)
    assert writes == [] and f"needs about {need / 2**20:.1f} MB" in str(err.value)
    _check_refusal(err.value, tmp_path)


def test_train_py_reports_disk_full_as_a_user_error():
    import runpy

    train_py = runpy.run_path(os.path.join(os.path.dirname(__file__), "..", "..", "train.py"))
    assert ckpt.DiskFull in train_py["user_errors"]()


def test_metrics_are_rewritten_in_place_when_the_disk_has_no_room_for_a_copy(tmp_path, monkeypatch, capsys):
    from types import SimpleNamespace

    from infclip.train.logger import MetricsLogger

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 7)) + '{"step": 7, "lo')
    logger = MetricsLogger(tmp_path, SimpleNamespace(progress=False, wandb_mode="disabled"), True, 10, {})
    real = type(path).write_text

    def full(self, *a, **k):
        if self.name.endswith(".tmp"):
            self.touch()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(type(path), "write_text", full)
    assert logger.drop_after(3) == 4
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3]
    assert not (tmp_path / "metrics.jsonl.tmp").exists() and "rewritten in place" in capsys.readouterr().out


@pytest.fixture
def tmpfs(tmp_path):
    """A 4 MB tmpfs (root only; skipped with the reason elsewhere)."""
    where = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("a real full disk needs a tmpfs mount, which needs root")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(where)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    yield where
    subprocess.run(["umount", str(where)], check=False)


def test_a_real_full_tmpfs(tmpfs):
    """1.5 MB checkpoints, keep_last=2, on 4 MB: the third does not fit; refused by the
    free-space check, and, with that check off, by the write torch reports as it does."""
    c = ckpt.Checkpointer(tmpfs, keep_last=2, rank=0, barrier=lambda: None)
    n = 3 * 2**17  # 1.5 MB of float32
    _save(c, 1, n)
    _save(c, 2, n)
    with pytest.raises(ckpt.DiskFull, match="not enough free space to start it") as err:
        _save(c, 3, n)
    assert f"mount point {tmpfs}" in str(err.value)
    c._check_room = lambda name, need: None
    with pytest.raises(ckpt.DiskFull, match="the write failed"):
        _save(c, 3, n)
    assert not list((tmpfs / "checkpoints").glob(".step_*"))
    assert _intact(tmpfs) == {"step_00000001": None, "step_00000002": None}
    shutil.rmtree(tmpfs / "checkpoints" / "step_00000001")  # room again: the next save works
    assert _save(c, 3, n).name == "step_00000003"
