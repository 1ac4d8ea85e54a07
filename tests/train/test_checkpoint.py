"""Atomic checkpoints, keep-last-k pruning, and the resume protection."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from infclip.train import checkpoint as ckpt


def _saver(tmp_path, keep=2):
    return ckpt.Checkpointer(tmp_path, keep_last=keep, rank=0, barrier=lambda: None)


def _save(c, step):
    return c.save(step, {"w": torch.full((2,), float(step))}, {"step": step}, {"rng": ckpt.rng_state(), "data": {}})


def test_save_load_roundtrip_and_weights_only(tmp_path):
    c = _saver(tmp_path)
    path = _save(c, 7)
    assert path.name == "step_00000007"
    model, train, rank = ckpt.load(path, rank=0)
    assert torch.equal(model["w"], torch.full((2,), 7.0)) and train["step"] == 7
    torch.load(path / "model.pt", weights_only=True)  # loadable by external tools


def test_keep_last_k_never_prunes_the_protected_one(tmp_path):
    c = _saver(tmp_path, keep=2)
    first = _save(c, 1)
    c.protected = first
    for s in (2, 3, 4):
        _save(c, s)
    names = [p.name for p in ckpt.list_checkpoints(tmp_path)]
    assert names == ["step_00000001", "step_00000003", "step_00000004"]


def test_rng_state_roundtrip():
    state = ckpt.rng_state()
    a = (torch.rand(3), __import__("random").random(), __import__("numpy").random.rand())
    ckpt.set_rng_state(state)
    b = (torch.rand(3), __import__("random").random(), __import__("numpy").random.rand())
    assert torch.equal(a[0], b[0]) and a[1:] == b[1:]


def test_kill_during_write_keeps_previous_checkpoint(tmp_path):
    """SIGKILL in the middle of writing step 2: step 1 stays the latest loadable one."""
    c = _saver(tmp_path)
    _save(c, 1)
    script = textwrap.dedent(f"""
        import os, torch
        from infclip.train import checkpoint as ckpt
        real = ckpt._save
        def dying(obj, path):
            real(obj, path)
            if path.name == "model.pt":
                os.kill(os.getpid(), 9)   # die after a partial write of the checkpoint
        ckpt._save = dying
        c = ckpt.Checkpointer({str(tmp_path)!r}, keep_last=2, rank=0, barrier=lambda: None)
        c.save(2, {{"w": torch.zeros(2)}}, {{"step": 2}}, {{"rng": None, "data": {{}}}})
    """)
    proc = subprocess.run([sys.executable, "-c", script], timeout=120)
    assert proc.returncode == -9
    assert (tmp_path / "checkpoints" / ".step_00000002.tmp").exists()
    latest = _saver(tmp_path).latest_loadable(world_size=1)
    assert latest.name == "step_00000001"
    model, _, _ = ckpt.load(latest, rank=0)
    assert torch.equal(model["w"], torch.full((2,), 1.0))
    _save(_saver(tmp_path), 3)  # the next save cleans the stale temporary directory
    assert not (tmp_path / "checkpoints" / ".step_00000002.tmp").exists()


def test_latest_requires_all_rank_files(tmp_path):
    c = _saver(tmp_path)
    _save(c, 1)
    assert c.latest_loadable(world_size=1) is not None
    assert c.latest_loadable(world_size=2) is None
    os.remove(tmp_path / "checkpoints" / "step_00000001" / "train.pt")
    assert c.latest_loadable(world_size=1) is None


def test_resaving_a_step_never_leaves_it_missing(tmp_path):
    c = _saver(tmp_path, keep=1)
    _save(c, 5)
    _save(c, 5)  # replaced via move-aside, not delete-then-write
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000005"]
    # a kill right after the move-aside: the next lookup restores the moved-aside copy
    root = tmp_path / "checkpoints"
    os.replace(root / "step_00000005", root / ".step_00000005.old")
    assert c.latest_loadable(world_size=1).name == "step_00000005"


def test_a_failed_write_raises_on_every_rank_instead_of_hanging(tmp_path):
    votes = []

    def agree(ok):  # stands in for the all-reduce: another rank reports failure
        votes.append(ok)
        return False if len(votes) == 2 else ok

    c = ckpt.Checkpointer(tmp_path, keep_last=2, rank=1, barrier=lambda: None, agree=agree)
    (tmp_path / "checkpoints" / ".step_00000001.tmp").mkdir(parents=True)  # rank 0's part
    import pytest

    with pytest.raises(RuntimeError, match="failed on another rank"):
        _save(c, 1)
    assert not ckpt.list_checkpoints(tmp_path)


def test_on_publish_files_are_in_the_published_folder_and_failures_publish_nothing(tmp_path):
    """The open_clip export hook writes into the temporary folder before the atomic rename:
    its files exist in every published checkpoint, and a failing hook publishes no checkpoint."""
    seen = []

    def hook(folder, model_state):
        seen.append(folder.name)
        (folder / "extra.txt").write_text(str(float(model_state["w"][0])))

    c = ckpt.Checkpointer(tmp_path, keep_last=2, rank=0, barrier=lambda: None, on_publish=hook)
    path = _save(c, 3)
    assert seen == [".step_00000003.tmp"] and (path / "extra.txt").read_text() == "3.0"

    def broken(folder, model_state):
        raise OSError("disk full")

    c.on_publish = broken
    try:
        _save(c, 4)
    except OSError:
        pass
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000003"]


def test_trainer_checkpoints_open_in_open_clip_alone(tmp_path):
    """A real train.py run: every checkpoint folder loads with open_clip's local-dir: in a
    process that never imports infclip, and its embeddings equal the trainer's model.pt ones."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = tmp_path / "run"
    cmd = [sys.executable, "train.py", "model.name=infclip-micro", f"run_dir={run}", "steps=2",
           "batch.global_size=8", "batch.micro_size=8", "eval.tasks=[]", "logging.progress=false",
           "data.workers=0", "data.loader_batch=8", "checkpoint.every_n_steps=1", "checkpoint.keep_last=5",
           f"data.synthetic_root={tmp_path / 'syn'}", "data.synthetic_train=16", "data.synthetic_eval=8",
           "data.synthetic_image_size=32", "logging.wandb_mode=disabled"]
    proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    folders = ckpt.list_checkpoints(run)
    assert [p.name for p in folders] == ["step_00000001", "step_00000002"]
    script = textwrap.dedent("""
        import sys, torch, open_clip
        folder, out = sys.argv[1], sys.argv[2]
        model, _, preprocess = open_clip.create_model_and_transforms("local-dir:" + folder)
        tokenizer = open_clip.get_tokenizer("local-dir:" + folder)
        torch.manual_seed(0)
        images = torch.rand(3, 3, 32, 32)
        with torch.no_grad():
            emb = (model.eval().encode_image(images), model.encode_text(tokenizer(["a red circle", "two"])))
        torch.save({"emb": emb, "infclip_imported": any(m.startswith("infclip") for m in sys.modules)}, out)
    """)
    import open_clip

    import infclip.model  # noqa: F401  registers infclip-micro for the reference model
    for folder in folders:
        out = tmp_path / f"{folder.name}.pt"
        proc = subprocess.run([sys.executable, "-c", script, str(folder), str(out)], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        theirs = torch.load(out)
        assert theirs["infclip_imported"] is False
        model, _, _ = open_clip.create_model_and_transforms("infclip-micro", pretrained=str(folder / "model.pt"))
        torch.manual_seed(0)
        images = torch.rand(3, 3, 32, 32)
        with torch.no_grad():
            ours = (model.eval().encode_image(images),
                    model.encode_text(open_clip.get_tokenizer("infclip-micro")(["a red circle", "two"])))
        assert torch.equal(theirs["emb"][0], ours[0]) and torch.equal(theirs["emb"][1], ours[1])


def test_open_clip_export_is_switchable_and_skips_non_clip_models():
    """checkpoint.open_clip_export=false (or a SimCLR image tower) installs no export hook."""
    import dataclasses

    from infclip.config import ModelConfig, TrainConfig
    from infclip.export import checkpoint_writer
    from infclip.model import build_model

    assert TrainConfig().checkpoint.open_clip_export is True
    built = build_model(ModelConfig(name="infclip-micro"))
    assert callable(checkpoint_writer(built, ModelConfig(name="infclip-micro")))
    assert checkpoint_writer(built, ModelConfig(name="infclip-micro"), enabled=False) is None
    assert checkpoint_writer(dataclasses.replace(built, model=built.model.visual), ModelConfig()) is None


def _damage(path, how):
    """Truncate, overwrite with random bytes of the same size, or cut train.pt to 1000 B."""
    import random

    target = path / ("train.pt" if how == "cut_train" else "model.pt")
    size = target.stat().st_size
    if how == "truncate":
        target.write_bytes(target.read_bytes()[: size // 2])
    elif how == "random":
        target.write_bytes(random.Random(0).randbytes(size))
    else:
        target.write_bytes(target.read_bytes()[:1000])


@pytest.mark.parametrize("how", ["truncate", "random", "cut_train"])
def test_damaged_newest_checkpoint_is_skipped_named_and_moved_aside(tmp_path, how):
    c = _saver(tmp_path, keep=3)
    for s in (1, 2):
        _save(c, s)
    newest = ckpt.list_checkpoints(tmp_path)[-1]
    _damage(newest, how)
    lines = []
    assert c.latest_loadable(world_size=1, warn=lines.append).name == "step_00000001"
    assert len(lines) == 1 and "step_00000002" in lines[0] and ("train.pt" if how == "cut_train" else "model.pt") in lines[0]
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000001"]
    assert (tmp_path / "checkpoints" / "step_00000002.damaged").is_dir()  # kept, never deleted
    _save(c, 2)  # the run continues and writes step 2 again: no collision
    assert c.latest_loadable(world_size=1).name == "step_00000002"


def test_manifest_covers_files_added_by_a_publish_hook_and_loads_weights_only(tmp_path):
    c = _saver(tmp_path)
    c.publish_hooks.append(lambda folder: (folder / "open_clip_config.json").write_text('{"embed_dim": 8}'))
    path = _save(c, 3)
    import json

    listed = json.loads((path / "manifest.json").read_text())["files"]
    assert sorted(listed) == ["model.pt", "open_clip_config.json", "rank_00000.pt", "train.pt"]
    for name in listed:  # every file loads without unpickling code
        if name.endswith(".pt"):
            torch.load(path / name, weights_only=True)
    (path / "open_clip_config.json").write_text('{"embed_dim": 9}')  # same size, other bytes
    assert "open_clip_config.json does not match" in ckpt.verify_checkpoint(path, 1)


def test_checkpoint_without_manifest_stays_loadable(tmp_path, capsys):
    """Written by an older version: no manifest, numpy's RNG tuple in the rank file."""
    import numpy as np

    legacy = tmp_path / "checkpoints" / "step_00000005"
    legacy.mkdir(parents=True)
    torch.save({"w": torch.ones(2)}, legacy / "model.pt")
    torch.save({"step": 5}, legacy / "train.pt")
    rng = {"python": __import__("random").getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    torch.save({"rng": rng, "data": {}}, legacy / "rank_00000.pt")
    c = _saver(tmp_path)
    assert c.latest_loadable(world_size=1) == legacy
    assert "has no manifest.json" in capsys.readouterr().err
    _, train, rank = ckpt.load(legacy, rank=0)
    ckpt.set_rng_state(rank["rng"])
    assert train["step"] == 5


def test_no_resumable_checkpoint_names_each_one_and_why(tmp_path):
    from types import SimpleNamespace

    from infclip.train.resume import ResumeError, _pick_checkpoint

    c = _saver(tmp_path, keep=3)
    for s in (1, 2):
        _save(c, s)
    for p in ckpt.list_checkpoints(tmp_path):
        (p / "model.pt").unlink()
    info = SimpleNamespace(world_size=1, rank=0)
    with pytest.raises(ResumeError) as e:
        _pick_checkpoint(SimpleNamespace(resume="auto"), info, tmp_path, c, lambda line: None)
    assert "step_00000002: model.pt is missing" in str(e.value) and "step_00000001" in str(e.value)
    assert "rank files" not in str(e.value)


def test_an_unfinished_save_is_removed_at_the_next_start_with_one_line(tmp_path):
    """A .step_N.tmp left by an interrupted save (kill, second Ctrl-C) goes at the next
    resume=auto start, named in one line; the complete checkpoints stay."""
    c = _saver(tmp_path, keep=3)
    _save(c, 1)
    tmp = tmp_path / "checkpoints" / ".step_00000002.tmp"
    tmp.mkdir()
    (tmp / "rank_00000.pt").write_bytes(b"partial")
    lines = []
    assert c.latest_loadable(world_size=1, warn=lines.append).name == "step_00000001"
    assert not tmp.exists() and len(lines) == 1 and ".step_00000002.tmp" in lines[0]
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000001"]


def test_a_verified_checkpoint_that_does_not_load_is_not_said_to_lack_a_manifest(tmp_path):
    """Resume said "has no manifest to verify it by" when the manifest verified and the load
    failed for another reason; now it names that reason."""
    from types import SimpleNamespace

    from infclip.train.resume import ResumeError, _load

    path = _save(_saver(tmp_path), 1)
    (path / "train.pt").write_bytes(b"written by something else")
    ckpt.write_manifest(path)  # consistent: the bytes are those the manifest lists
    assert ckpt.verify_checkpoint(path, 1) is None
    with pytest.raises(ResumeError) as err:
        _load(path, SimpleNamespace(rank=0, device="cpu"))
    assert "matches its manifest but cannot be loaded" in str(err.value) and "no manifest" not in str(err.value)


def test_the_data_position_error_names_a_way_that_exists():
    """It advised to "start the data stream afresh", which no key or command does (defect 11)."""
    from infclip.data.pipeline import TrainData
    from infclip.data.shards import DataError
    from infclip.data.stream import StreamSpec

    data = TrainData(StreamSpec(["a.tar", "b.tar"], [1.0, 1.0], False, 0, 0, 1, 4, 2, 0), None, None, 1, 8)
    saved = {**data.state_dict(), "seed": 1}
    with pytest.raises(DataError) as err:
        data.load_state_dict(saved)
    message = str(err.value)
    assert "seed was 1 now 0" in message and "afresh" not in message.split("model.pretrained")[0]
    assert "model.pretrained=<checkpoint>/model.pt" in message


def test_preprocess_overrides_reach_training_eval_and_the_open_clip_export(tmp_path):
    """model.image_mean/std/interpolation/resize_mode: the trainer's normalization, its eval
    transform, and the exported open_clip_config.json, which open_clip's local-dir: loader
    (what clip_benchmark uses) turns into the same transform."""
    import json

    import open_clip
    from torchvision.transforms import InterpolationMode, Normalize, Resize

    from infclip.config import ModelConfig
    from infclip.export import checkpoint_writer
    from infclip.model import build_model

    mcfg = ModelConfig(name="infclip-micro", image_mean=[0.5, 0.5, 0.5], image_std=[0.25, 0.5, 0.75],
                       image_interpolation="bilinear", image_resize_mode="squash")
    built = build_model(mcfg)
    assert built.mean == (0.5, 0.5, 0.5) and built.std == (0.25, 0.5, 0.75)  # the trainer's Normalizer
    ours = built.preprocess_val.transforms
    folder = tmp_path / "export"
    checkpoint_writer(built, mcfg)(folder, built.model.state_dict())
    pp = json.loads((folder / "open_clip_config.json").read_text())["preprocess_cfg"]
    assert pp["mean"] == [0.5, 0.5, 0.5] and pp["std"] == [0.25, 0.5, 0.75]
    assert pp["interpolation"] == "bilinear" and pp["resize_mode"] == "squash"
    model, _, theirs = open_clip.create_model_and_transforms("local-dir:" + str(folder))
    assert list(model.visual.preprocess_cfg["mean"]) == [0.5, 0.5, 0.5]
    for transforms in (ours, theirs.transforms):
        norm = next(t for t in transforms if isinstance(t, Normalize))
        resize = next(t for t in transforms if isinstance(t, Resize))
        assert list(norm.mean) == [0.5, 0.5, 0.5] and list(norm.std) == [0.25, 0.5, 0.75]
        assert resize.interpolation == InterpolationMode.BILINEAR and resize.size == (32, 32)  # squash
    image = torch.rand(3, 40, 56)
    from torchvision.transforms.functional import to_pil_image

    assert torch.equal(built.preprocess_val(to_pil_image(image)), theirs(to_pil_image(image)))


@pytest.mark.parametrize("override, match", [
    ("model.image_mean=[0.5,0.5]", r"model.image_mean must be null or 3 per-channel"),
    ("model.image_std=[0.5,0,0.5]", r"model.image_std must be null or 3 .* > 0"),
    ("model.image_interpolation=nearest", r"model.image_interpolation='nearest': choose bicubic, bilinear"),
    ("model.image_resize_mode=crop", r"model.image_resize_mode='crop': choose shortest, longest, squash"),
])
def test_bad_preprocess_overrides_name_the_key(override, match):
    from hydra import compose, initialize_config_dir

    from infclip.config import ConfigError, register_configs, validate

    register_configs()
    configs = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")
    with initialize_config_dir(config_dir=configs, version_base="1.3"):
        cfg = compose(config_name="train", overrides=[override])
    with pytest.raises(ConfigError, match=match):
        validate(cfg, 1)
