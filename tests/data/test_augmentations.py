"""open_clip's --aug-cfg options (colour jitter, greyscale, random erasing, timm's pipeline):
each changes the pixels as it should, is a pure function of the per-batch seed (resume and the
gradient cache's two passes read the same uint8 pixels), and is refused with data.decode=device."""

import io
import random
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from PIL import Image

from data_helpers import IdTokenizer
from infclip.config import ConfigError, register_configs, validate
from infclip.data.config import DataConfig, augmentation_keys, check_data_config
from infclip.data.pipeline import build_train_data
from infclip.data.transforms import train_transform

MEAN, STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
JITTER = (0.8, 0.8, 0.8, 0.2)
register_configs()


def _jpeg(seed: int = 0, side: int = 64) -> bytes:
    """A colourful JPEG: smooth random blobs (so jitter and greyscale have colour to change)."""
    g = torch.Generator().manual_seed(seed)
    small = torch.randint(0, 256, (3, 8, 8), generator=g, dtype=torch.uint8).float()
    pixels = torch.nn.functional.interpolate(small[None], size=(side, side), mode="bilinear")[0]
    buf = io.BytesIO()
    Image.fromarray(pixels.round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()).save(buf, "JPEG")
    return buf.getvalue()


def _run(transform, data, seed=0):
    """The transform under a loader batch's seeding (torch and Python's global RNG)."""
    torch.manual_seed(seed)
    random.seed(seed)
    image = data if getattr(transform, "decodes_bytes", False) else Image.open(io.BytesIO(data)).convert("RGB")
    return transform(image)


@pytest.mark.parametrize("draft", [True, False])
def test_gray_scale_prob_one_gives_equal_channels_and_the_same_crop(draft):
    plain = _run(train_transform(32, MEAN, STD, draft=draft), _jpeg())
    gray = _run(train_transform(32, MEAN, STD, draft=draft, gray_scale_prob=1.0), _jpeg())
    assert gray.dtype == torch.uint8 and gray.shape == (3, 32, 32)
    assert torch.equal(gray[0], gray[1]) and torch.equal(gray[1], gray[2])
    assert not torch.equal(plain[0], plain[1])  # the crop had colour
    # ITU-R 601 luma of the same crop (greyscale comes after it; the crop's draws are unchanged)
    luma = (0.299 * plain[0].float() + 0.587 * plain[1].float() + 0.114 * plain[2].float())
    assert (luma - gray[0].float()).abs().max() < 2  # torchvision truncates, PIL rounds


def test_color_jitter_changes_colour_statistics_not_the_crop():
    plain = _run(train_transform(32, MEAN, STD), _jpeg()).float()
    outs = [_run(train_transform(32, MEAN, STD, color_jitter=JITTER), _jpeg(), seed=s).float() for s in range(4)]
    # the jittered pixels stay correlated with the crop's (same box), but the channel stats move
    for out in outs:
        assert out.shape == plain.shape
        assert (out.mean((1, 2)) - plain.mean((1, 2))).abs().max() > 2 or \
               (out.std((1, 2)) - plain.std((1, 2))).abs().max() > 2
    assert len({tuple(o.mean((1, 2)).tolist()) for o in outs}) == 4  # each seed draws its own factors
    # color_jitter_prob=0 turns it off: exactly the plain crop
    off = _run(train_transform(32, MEAN, STD, color_jitter=JITTER, color_jitter_prob=0.0), _jpeg()).float()
    assert torch.equal(off, plain)


def test_color_jitter_prob_is_a_per_sample_coin():
    t = train_transform(16, MEAN, STD, color_jitter=JITTER, color_jitter_prob=0.5)
    plain = train_transform(16, MEAN, STD)
    same = sum(torch.equal(_run(t, _jpeg(), s), _run(plain, _jpeg(), s)) for s in range(40))
    assert 8 <= same <= 32  # about half untouched


@pytest.mark.parametrize("use_timm", [False, True])
def test_random_erasing_fills_a_box_with_noise_and_leaves_the_rest(use_timm):
    kw = {"use_timm": use_timm}
    plain = _run(train_transform(48, MEAN, STD, **kw), _jpeg(side=96))
    erased = _run(train_transform(48, MEAN, STD, re_prob=1.0, **kw), _jpeg(side=96))
    assert erased.dtype == torch.uint8 and erased.shape == (3, 48, 48)
    changed = (erased != plain).any(0)
    assert changed.any()
    rows, cols = changed.any(1).nonzero()[:, 0], changed.any(0).nonzero()[:, 0]
    box = (slice(int(rows.min()), int(rows.max()) + 1), slice(int(cols.min()), int(cols.max()) + 1))
    outside = torch.ones_like(changed)
    outside[box] = False
    assert torch.equal(erased[:, outside], plain[:, outside])  # pixels outside the box untouched
    noise = erased[:, box[0], box[1]].float()
    assert noise.std() > 30 and len(noise.unique()) > 50  # per-pixel normal noise (timm's re_mode=pixel)
    # its mean is the normalization mean (zero in normalized space), within the clamp's skew
    assert (noise.mean((1, 2)) / 255 - torch.tensor(MEAN)).abs().max() < 0.1


@pytest.mark.parametrize("kw", [
    {"color_jitter": JITTER, "color_jitter_prob": 0.8, "gray_scale_prob": 0.2, "re_prob": 0.5, "re_count": 2},
    {"color_jitter": JITTER, "color_jitter_prob": 0.8, "gray_scale_prob": 0.2, "re_prob": 0.5, "draft": False},
    {"use_timm": True, "color_jitter": (0.4,), "re_prob": 0.5},
])
def test_augmentations_are_a_pure_function_of_the_seed(kw):
    t = train_transform(32, MEAN, STD, **kw)
    a = [_run(t, _jpeg(i), seed=i) for i in range(6)]
    random.seed(99)  # the caller's state must not matter
    torch.manual_seed(99)
    b = [_run(t, _jpeg(i), seed=i) for i in range(6)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    c = [_run(t, _jpeg(i), seed=i + 100) for i in range(6)]
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


def test_loader_batches_with_augmentations_repeat_and_resume(shards, tmp_path):
    """Through the real loader: two builds give identical batches whatever Python's global RNG
    holds in the trainer, and a resumed loader gives the uninterrupted run's pixels."""
    shards([12] * 4)
    spec = str(tmp_path / "shards" / "{00000..00003}.tar")
    t = train_transform(8, MEAN, STD, color_jitter=JITTER, color_jitter_prob=0.5, gray_scale_prob=0.3,
                        re_prob=0.5)

    def build(workers):
        cfg = DataConfig(kind="wds", shards=spec, loader_batch=4, workers=workers, shuffle_buffer=5)
        return build_train_data(cfg, transform=t, tokenizer=IdTokenizer(), rank=0, world_size=1, seed=3,
                                num_samples=48)

    data = build(2)
    it = data.batches()
    first = [next(it) for _ in range(3)]
    state = data.state_dict()
    rest = [next(it) for _ in range(4)]
    random.seed(12345)
    inproc = build(0)
    before = random.getstate()
    again = [next(inproc.batches()) for _ in range(1)]
    assert random.getstate() == before  # in-process loading leaves the trainer's Python RNG alone
    assert torch.equal(again[0][0], first[0][0])
    resumed = build(2)
    resumed.load_state_dict(state)
    it2 = resumed.batches()
    for (ri, rt), (ai, at) in zip(rest, [next(it2) for _ in range(4)]):
        assert torch.equal(rt, at) and torch.equal(ri, ai)


@pytest.mark.parametrize("kw, match", [
    ({"color_jitter_prob": 1.5}, r"data.color_jitter_prob is a probability and must be in \[0, 1\], got 1.5"),
    ({"gray_scale_prob": -0.1}, r"data.gray_scale_prob is a probability"),
    ({"re_prob": float("nan")}, r"data.re_prob is a probability"),
    ({"re_count": 0}, r"data.re_count must be >= 1"),
    ({"color_jitter": [0.4, 0.4]}, r"data.color_jitter must be \[\], \[strength\]"),
    ({"color_jitter": [0.4, 0.4, -0.4]}, r"data.color_jitter must be"),
    ({"color_jitter": [0.4, 0.4, 0.4, 0.7]}, r"hue \(4th value\) must be in \[0, 0.5\]"),
    ({"use_timm": True, "gray_scale_prob": 0.2}, r"data.use_timm=true .* no data.color_jitter_prob or "
                                                 r"data.gray_scale_prob"),
])
def test_bad_augmentation_values_name_the_key(kw, match):
    with pytest.raises(ValueError, match=match):
        check_data_config(DataConfig(**kw))


def _compose(*overrides):
    configs = str(Path(__file__).resolve().parents[2] / "configs")
    with initialize_config_dir(config_dir=configs, version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


@pytest.mark.parametrize("aug", ["data.color_jitter=[0.4,0.4,0.4,0.1]", "data.gray_scale_prob=0.2",
                                 "data.re_prob=0.25", "data.use_timm=true"])
def test_device_decode_with_an_augmentation_is_refused_and_auto_picks_cpu(aug):
    from infclip.train.build import resolve_decode

    key = aug.split("=")[0]
    with pytest.raises(ConfigError) as e:
        validate(_compose(aug, "data.decode=device"), 1)
    msg = str(e.value)
    assert key in msg and "Set data.decode=cpu" in msg and "\n" not in msg  # one paragraph
    cfg = _compose(aug)  # decode=auto: valid, and the CPU pipeline is chosen, saying why
    validate(cfg, 1)
    decode, why = resolve_decode(cfg, torch.device("cuda"))
    assert decode == "cpu" and key in why and "only crops" in why
    assert augmentation_keys(cfg.data) == [key]


def test_crop_only_config_has_no_augmentation_keys():
    assert augmentation_keys(DataConfig()) == []
    assert augmentation_keys(DataConfig(color_jitter=[0.0, 0.0, 0.0])) == []
    assert augmentation_keys(DataConfig(color_jitter=[0.4], color_jitter_prob=0.0)) == []
