"""The patchify convolution as one GEMM (infclip/patch_embed.py): same math as the
convolution in float64, same parameters and state-dict keys, chosen only for patchify convs."""

import open_clip
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from infclip.patch_embed import PatchMatmulConv2d, is_patchify, low_precision, patch_matmul, patchify_as_matmul


@pytest.mark.parametrize("shape", [(3, 3, 224, 224, 768, 32), (2, 3, 64, 48, 40, 16), (1, 1, 30, 45, 7, 15)])
@pytest.mark.parametrize("bias", [False, True])
def test_patch_matmul_equals_the_strided_convolution(shape, bias):
    b, c, h, w, out, p = shape
    g = torch.Generator().manual_seed(sum(shape) + bias)
    x = torch.randn(b, c, h, w, dtype=torch.float64, generator=g)
    weight = torch.randn(out, c, p, p, dtype=torch.float64, generator=g)
    bb = torch.randn(out, dtype=torch.float64, generator=g) if bias else None
    got, ref = patch_matmul(x, weight, bb), F.conv2d(x, weight, bb, stride=p)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-10)
    # open_clip's next step (flatten the grid, tokens first) needs no copy of the result
    assert got.reshape(b, out, -1).permute(0, 2, 1).is_contiguous()


def test_patch_matmul_gradients_equal_the_convolution():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(12, 3, 8, 8, dtype=torch.float64, generator=g, requires_grad=True)
    up = torch.randn(2, 12, 4, 4, dtype=torch.float64, generator=g)
    grads = [torch.autograd.grad((fn(x, w) * up).sum(), (x, w))
             for fn in (patch_matmul, lambda x, w: F.conv2d(x, w, stride=8))]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_only_patchify_convolutions_are_reclassed():
    model = nn.Sequential(nn.Conv2d(3, 8, 4, stride=4), nn.Conv2d(8, 8, 3, stride=1, padding=1),
                          nn.Conv2d(8, 8, 2, stride=2, padding=1), nn.Conv2d(8, 8, 2, stride=2, groups=2),
                          nn.Conv2d(8, 8, 1), nn.Conv2d(8, 8, 2, stride=2))
    assert [is_patchify(m) for m in model] == [True, False, False, False, False, False]
    assert patchify_as_matmul(model) == ["0"]
    assert type(model[0]) is PatchMatmulConv2d and all(type(m) is nn.Conv2d for m in model[1:])


def test_a_resnet_keeps_every_convolution():
    model = open_clip.create_model("RN50")
    assert patchify_as_matmul(model) == []


def test_open_clip_vit_keeps_its_keys_and_outputs():
    torch.manual_seed(0)
    model = open_clip.create_model("ViT-B-32").eval()
    ref_keys = list(model.state_dict())
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        ref = model.encode_image(x)
    weight = model.visual.conv1.weight
    assert patchify_as_matmul(model) == ["visual.conv1"]
    assert list(model.state_dict()) == ref_keys and model.visual.conv1.weight is weight
    with torch.no_grad():  # on the CPU the module *is* the convolution: bit for bit
        assert torch.equal(model.encode_image(x), ref)


def test_gemm_only_in_low_precision():
    x = torch.zeros(1, 3, 8, 8)
    assert not low_precision(x) and low_precision(x.bfloat16()) and low_precision(x.half())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert low_precision(x)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GEMM path runs on CUDA")
def test_cuda_bf16_takes_the_gemm_fp32_the_convolution():
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 64, 16, stride=16, bias=False).cuda()
    x = torch.randn(4, 3, 224, 224, device="cuda")
    ref32, ref64 = conv(x), F.conv2d(x.double(), conv.weight.double(), stride=16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref16 = conv(x)
    patchify_as_matmul(conv)
    assert torch.equal(conv(x), ref32)  # fp32: the convolution itself
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = conv(x)
    assert got.dtype == torch.bfloat16
    # no worse than cuDNN's bf16 convolution against float64
    assert (got.double() - ref64).abs().max() <= 1.5 * (ref16.double() - ref64).abs().max()
