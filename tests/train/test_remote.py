"""checkpoint.remote: each published checkpoint mirrored to an fsspec URL (manifest last),
pruned as locally, and fetched back (verified) when the run folder has none."""

import shutil
import uuid

import fsspec
import pytest
import torch

from infclip.manifest import MANIFEST
from infclip.train import checkpoint as ckpt
from infclip.train.remote import RemoteCheckpoints
from tests.train.test_train_cli import losses, run_train


def _mirrored(tmp_path, url, keep=2):
    """A rank-0 checkpointer mirroring to ``url``; returns it and the warning lines."""
    lines: list[str] = []
    c = ckpt.Checkpointer(tmp_path / "run", keep_last=keep, rank=0, barrier=lambda: None)
    c.remote = RemoteCheckpoints(url, keep, warn=lines.append)
    return c, lines


def _save(c, step):
    return c.save(step, {"w": torch.full((2,), float(step))}, {"step": step}, {"rng": ckpt.rng_state(), "data": {}})


@pytest.fixture
def memory_url():
    url = f"memory://infclip-{uuid.uuid4().hex[:8]}"
    yield url
    fs, root = fsspec.core.url_to_fs(url)
    if fs.exists(root):
        fs.rm(root, recursive=True)


def _remote_bytes(url, name):
    fs, root = fsspec.core.url_to_fs(url)
    base = f"{root}/checkpoints/{name}"
    return {p[len(base) + 1:]: fs.cat_file(p) for p in fs.find(base)}


def test_mirror_is_complete_after_each_publish_and_pruned_as_locally(tmp_path, memory_url):
    c, lines = _mirrored(tmp_path, memory_url, keep=2)
    for s in (1, 2, 3):
        local = _save(c, s)
        remote = _remote_bytes(memory_url, local.name)
        assert remote == {p.name: p.read_bytes() for p in local.iterdir()}  # manifest included
        assert MANIFEST in remote
    assert c.remote.complete() == ["step_00000002", "step_00000003"] == [p.name for p in ckpt.list_checkpoints(tmp_path / "run")]
    assert lines == []


def test_an_upload_without_manifest_is_not_complete_and_is_pruned(tmp_path, memory_url):
    c, _ = _mirrored(tmp_path, memory_url, keep=2)
    _save(c, 1)
    fs, root = fsspec.core.url_to_fs(memory_url)
    fs.rm(f"{root}/checkpoints/step_00000001/{MANIFEST}")  # as an upload cut before its manifest
    assert c.remote.complete() == []
    assert c.remote.fetch_latest(tmp_path / "elsewhere", world_size=1) is None
    _save(c, 2)
    assert c.remote._step_names() == ["step_00000002"]


def test_fetch_verifies_and_falls_back_from_a_tampered_remote_file(tmp_path, memory_url):
    c, lines = _mirrored(tmp_path, memory_url, keep=3)
    for s in (1, 2):
        _save(c, s)
    fs, root = fsspec.core.url_to_fs(memory_url)
    path = f"{root}/checkpoints/step_00000002/model.pt"
    data = bytearray(fs.cat_file(path))
    data[-10] ^= 0xFF  # same size, other bytes
    fs.pipe_file(path, bytes(data))
    dest = tmp_path / "fresh" / "checkpoints"
    dest.mkdir(parents=True)
    got = c.remote.fetch_latest(dest, world_size=1)
    assert got == dest / "step_00000001"
    assert len(lines) == 1 and "step_00000002" in lines[0] and "model.pt" in lines[0] and "SHA-256" in lines[0]
    assert sorted(p.name for p in dest.iterdir()) == ["step_00000001"]  # nothing of the refused one left
    assert ckpt.verify_checkpoint(got, 1) is None


def test_a_failing_remote_write_warns_and_the_local_checkpoint_stands(tmp_path, memory_url, monkeypatch):
    c, lines = _mirrored(tmp_path, memory_url)

    def refuse(*args, **kwargs):
        raise PermissionError("access denied")

    monkeypatch.setattr(c.remote.fs, "put_file", refuse)
    path = _save(c, 1)
    assert ckpt.verify_checkpoint(path, 1) is None
    assert len(lines) == 1 and "could not mirror step_00000001" in lines[0] and "access denied" in lines[0]


# ----------------------------------------------------------------------------- real train.py

BASE = ["eval.tasks=[]", "checkpoint.every_n_steps=2", "checkpoint.keep_last=2"]


def test_resume_from_the_remote_reproduces_the_uninterrupted_run(tmp_path):
    remote = tmp_path / "bucket"
    full = tmp_path / "full"
    run_train(tmp_path, f"run_dir={full}", "steps=4", *BASE)
    part = tmp_path / "part"
    run_train(tmp_path, f"run_dir={part}", "steps=2", *BASE, f"checkpoint.remote=file://{remote}")
    assert (remote / "checkpoints" / "step_00000002" / MANIFEST).is_file()
    shutil.rmtree(part / "checkpoints")  # the local copy is lost (a node's scratch disk, say)
    proc = run_train(tmp_path, f"run_dir={part}", "steps=4", *BASE, f"checkpoint.remote=file://{remote}")
    assert "downloaded step_00000002 from file://" in proc.stdout and "resumed from" in proc.stdout
    resumed, ref = losses(part), losses(full)
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in (3, 4):
        assert resumed[step] == pytest.approx(ref[step], rel=1e-6, abs=1e-7), (step, resumed, ref)
    assert sorted(p.name for p in (remote / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]


def test_an_unwritable_remote_warns_and_training_goes_on(tmp_path):
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("a file where the remote folder would be")
    run_dir = tmp_path / "run"
    proc = run_train(tmp_path, f"run_dir={run_dir}", "steps=2", *BASE, f"checkpoint.remote=file://{blocker}/run")
    assert "warning: could not mirror step_00000002" in proc.stdout
    assert sorted(losses(run_dir)) == [1, 2]
    assert ckpt.verify_checkpoint(run_dir / "checkpoints" / "step_00000002", 1) is None


def test_a_remote_that_cannot_be_read_at_start_is_refused(tmp_path, memory_url, monkeypatch):
    from infclip.train.resume import ResumeError, _remote_names

    remote = RemoteCheckpoints(memory_url, 2)

    def denied(*args, **kwargs):
        raise PermissionError("no credentials")

    monkeypatch.setattr(remote.fs, "ls", denied)
    with pytest.raises(ResumeError, match=r"checkpoint.remote=.*cannot be read.*no credentials.*checkpoint.remote=null"):
        _remote_names(remote)
