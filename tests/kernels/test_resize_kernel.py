"""The one-launch crop-and-resize kernel (infclip.kernels.resize) against its PyTorch
reference, and the reference against PIL (the CPU training path's resampler).

On CPU the kernel runs through Triton's interpreter (shapes kept small)."""

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms.functional import InterpolationMode
from torchvision.transforms.functional import resized_crop as tv_resized_crop

from infclip.kernels.resize import bicubic_weights, crop_index, resized_crop, resized_crop_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def smooth_image(h: int, w: int, seed: int) -> torch.Tensor:
    """(h, w, 3) uint8: a random smooth field plus noise (like a photo: edges and texture)."""
    g = torch.Generator().manual_seed(seed)
    low = torch.rand((3, max(2, h // 6), max(2, w // 6)), generator=g)
    up = torch.nn.functional.interpolate(low[None], size=(h, w), mode="bilinear", align_corners=False)[0]
    img = up * 230 + torch.rand((3, h, w), generator=g) * 25
    return img.clamp(0, 255).to(torch.uint8).permute(1, 2, 0).contiguous()


def random_box(h: int, w: int, g: torch.Generator) -> list[int]:
    bh, bw = int(torch.randint(1, h + 1, (1,), generator=g)), int(torch.randint(1, w + 1, (1,), generator=g))
    return [int(torch.randint(0, h - bh + 1, (1,), generator=g)), int(torch.randint(0, w - bw + 1, (1,), generator=g)),
            bh, bw]


@pytest.mark.parametrize("size", [7, 16, 19])
def test_kernel_matches_the_reference_on_mixed_sizes_and_boxes(size):
    """Down- and upscales, boxes at the borders, whole images, 1-pixel boxes: within one level,
    almost all exact (the two differ only in where float32 rounds a tie)."""
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    g = torch.Generator().manual_seed(seed)
    shapes = [(23, 31), (40, 17), (9, 9), (50, 64), (3, 45), (33, 33)]
    images = [smooth_image(h, w, seed + i).to(DEV) for i, (h, w) in enumerate(shapes)]
    boxes = [random_box(h, w, g) for h, w in shapes]
    boxes[2] = [0, 0, 9, 9]  # the whole image
    boxes[3] = [0, 0, 50, 64]  # a strong downscale (~3x at size 16)
    boxes[4] = [2, 44, 1, 1]  # one pixel in the corner
    boxes = torch.tensor(boxes)
    got = resized_crop(images, boxes, size)
    ref = resized_crop_reference(images, boxes, size)
    assert got.shape == (len(shapes), 3, size, size) and got.dtype == torch.uint8
    d = (got.int() - ref.int()).abs()
    assert d.max() <= 1, (seed, d.max())
    assert (d > 0).float().mean() < 0.01, (seed, (d > 0).float().mean())
    assert torch.equal(got[4], got[4][:, :1, :1].expand(3, size, size))  # one pixel -> a flat image


def test_kernel_reads_images_with_any_strides():
    """Decoders may pad rows (pitch > 3 W) or return planar images seen as (H, W, 3): views
    give the same pixels as contiguous copies."""
    full = [smooth_image(20, 40, 1).to(DEV), smooth_image(18, 30, 2).to(DEV)]
    planar = smooth_image(18, 26, 3).to(DEV).permute(2, 0, 1).contiguous().permute(1, 2, 0)
    views = [full[0][:, :25], full[1][:, 3:29], planar]  # pitch 120 and 90 bytes; planar (CHW) strides
    boxes = torch.tensor([[2, 1, 15, 20], [0, 5, 18, 21], [1, 2, 16, 20]])
    contiguous = [v.contiguous() for v in views]
    assert torch.equal(resized_crop(views, boxes, 11), resized_crop(contiguous, boxes, 11))


def test_reference_matches_pil_within_one_level():
    """The reference is PIL's resampler (torchvision's resized_crop on a PIL image) up to
    fixed- vs floating-point weights."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    images = [smooth_image(h, w, i) for i, (h, w) in enumerate([(60, 80), (45, 30), (24, 24), (100, 70)])]
    boxes = torch.tensor([random_box(im.shape[0], im.shape[1], g) for im in images])
    ref = resized_crop_reference(images, boxes, 24)
    for im, box, r in zip(images, boxes.tolist(), ref):
        pil = tv_resized_crop(Image.fromarray(im.numpy()), *box, [24, 24], InterpolationMode.BICUBIC)
        want = torch.from_numpy(np.array(pil)).permute(2, 0, 1).int()
        d = (r.int() - want).abs()
        assert d.max() <= 1, (box, d.max())


def test_uniform_image_stays_uniform_under_any_box():
    """The weights of every output pixel sum to one, whatever the scale."""
    img = torch.full((37, 29, 3), 200, dtype=torch.uint8, device=DEV)
    img[..., 1] = 17
    boxes = torch.tensor([[0, 0, 37, 29], [5, 3, 2, 20], [1, 1, 30, 4]])
    out = resized_crop([img] * 3, boxes, 13)
    assert (out[:, 0] == 200).all() and (out[:, 1] == 17).all() and (out[:, 2] == 200).all()


def test_bad_layout_and_boxes_are_refused():
    chw = torch.zeros((3, 10, 10), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"\(H, W, 3\)"):
        crop_index([chw], torch.tensor([[0, 0, 3, 3]]))
    with pytest.raises(ValueError, match="outside"):
        crop_index([torch.zeros((10, 10, 3), dtype=torch.uint8)], torch.tensor([[5, 0, 6, 3]]))
    assert resized_crop([], torch.zeros((0, 4), dtype=torch.int64), 8).shape == (0, 3, 8, 8)


def test_bicubic_weights_are_normalized_inside_the_crop_and_zero_outside():
    start, length = torch.tensor([0, 5, 17]), torch.tensor([40, 10, 3])
    w = bicubic_weights(start, length, out=8, size=40)
    assert torch.allclose(w.sum(-1), torch.ones(3, 8), atol=1e-6)
    cols = torch.arange(40)
    for n in range(3):
        outside = (cols < start[n]) | (cols >= start[n] + length[n])
        assert not w[n][:, outside].any()
    # identity when the crop already has the output size
    eye = bicubic_weights(torch.tensor([2]), torch.tensor([8]), out=8, size=12)[0]
    assert torch.allclose(eye[:, 2:10], torch.eye(8), atol=1e-6)
