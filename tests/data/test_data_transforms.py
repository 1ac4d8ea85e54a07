"""uint8 transforms and on-device normalization agree with open_clip's float transforms."""

import torch
from open_clip.transform import image_transform
from PIL import Image
from torchvision.transforms import RandomResizedCrop

from infclip.data.transforms import Normalizer, train_transform, val_transform

MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)


def _image():
    g = torch.Generator().manual_seed(0)
    return Image.fromarray(torch.randint(0, 256, (50, 70, 3), generator=g, dtype=torch.uint8).numpy())


def test_val_transform_matches_open_clip_after_normalizer():
    img = _image()
    ours = val_transform(32, MEAN, STD)(img)
    assert ours.dtype == torch.uint8 and ours.shape == (3, 32, 32)
    ref = image_transform(32, is_train=False, mean=MEAN, std=STD)(img)
    got = Normalizer(MEAN, STD)(ours[None])[0]
    # open_clip normalizes the float image; ours quantizes to uint8 first (exact here: PIL output is uint8)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_train_transform_uses_paper_augmentation_and_uint8():
    t = train_transform(24, MEAN, STD, aug_scale=(0.08, 1.0), aug_ratio=(0.75, 1.3333333), draft=False)
    rrc = [x for x in t.transforms if isinstance(x, RandomResizedCrop)]
    assert len(rrc) == 1 and rrc[0].scale == (0.08, 1.0) and rrc[0].ratio == (0.75, 1.3333333)
    drafted = train_transform(24, MEAN, STD, aug_scale=(0.08, 1.0), aug_ratio=(0.75, 1.3333333))
    assert drafted.scale == [0.08, 1.0] and drafted.ratio == [0.75, 1.3333333] and drafted.draft
    for transform in (t, drafted):  # a loaded image: no draft, the same pixels
        torch.manual_seed(0)
        a = transform(_image())
        torch.manual_seed(0)
        b = t(_image())
        assert a.dtype == torch.uint8 and a.shape == (3, 24, 24) and torch.equal(a, b)


def test_normalizer_rejects_float_and_keeps_dtype_choice():
    n = Normalizer(MEAN, STD)
    x = torch.full((2, 3, 4, 4), 255, dtype=torch.uint8)
    y = n(x)
    torch.testing.assert_close(y[0, :, 0, 0], torch.tensor([(1 - m) / s for m, s in zip(MEAN, STD)]))
    assert n(x, dtype=torch.bfloat16).dtype == torch.bfloat16
    try:
        n(x.float())
    except TypeError:
        pass
    else:
        raise AssertionError("float input must be rejected")
