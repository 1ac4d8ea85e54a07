"""Towers on a green-context stream (``data.decode_reserved_sms``): same results, what it costs.

    python scripts/check_sm_partition.py [--reserve 4,12] [--batch 256]

First the references on the ordinary stream, every SM, before any partition exists (the
loss's grids are then sized for the whole device), each run twice: "control" says whether
two runs on the same stream agree bit for bit at all (attention backward kernels may use
atomics). Then for each reserve it builds the partitioned stream
(infclip/train/sm_partition.py) and prints one table row: the partition, bf16 8192^3 matmul
TFLOP/s on it against every SM, a compiled ViT-B/32 forward + backward (open_clip, bf16
autocast) in samples/s, the Triton CLIP loss forward + backward at b = 8,192 (replayed from
CUDA graphs captured on a side stream) and 32,768 (strips) in ms, and whether each result is
bit-identical to the reference. Needs CUDA and cuda-bindings.
"""

from __future__ import annotations

import argparse
import time

import torch

LOSS_B = (8192, 32768)


def rate(fn, stream, seconds: float = 2.0) -> float:
    """Calls of ``fn`` per second on ``stream`` (synchronized on it only)."""
    with torch.cuda.stream(stream):
        fn()
        stream.synchronize()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            fn()
            n += 1
        stream.synchronize()
        return n / (time.perf_counter() - t0)


def tower_step(model, images, tokens):
    """Forward + backward of both towers: (loss, gradient of every parameter)."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        img, txt = model.encode_image(images), model.encode_text(tokens)
    loss = (img.float() @ txt.float().T).logsumexp(1).mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def loss_step(img, txt, scale):
    """The CLIP loss forward + backward: (loss, d image, d text)."""
    from infclip.loss import clip_loss

    i, t = img.detach().requires_grad_(), txt.detach().requires_grad_()
    loss = clip_loss(i, t, scale)
    loss.backward()
    return loss.detach(), [i.grad, t.grad]


def same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


def setup(batch: int):
    """(tower closure, {b: loss closure}, matmul closure) on fixed random inputs."""
    import open_clip

    torch.manual_seed(0)
    model = open_clip.create_model("ViT-B-32").cuda().train()
    model.encode_image = torch.compile(model.encode_image)
    model.encode_text = torch.compile(model.encode_text)
    images = torch.randn(batch, 3, 224, 224, device="cuda")
    tokens = torch.randint(1, 49000, (batch, 77), device="cuda")
    scale = torch.tensor(14.3, device="cuda", requires_grad=True)
    losses = {}
    for b in LOSS_B:
        img, txt = (torch.nn.functional.normalize(torch.randn(b, 512, device="cuda"), dim=1).bfloat16()
                    for _ in range(2))
        losses[b] = lambda img=img, txt=txt: loss_step(img, txt, scale)
    mat = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return (lambda: tower_step(model, images, tokens)), losses, (lambda: mat @ mat)


def results(towers, losses) -> dict:
    """Each workload's result on the current stream (the loss's third call: a graph replay at 8k)."""
    return {"towers": towers(), **{b: [fn() for _ in range(3)][-1] for b, fn in losses.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reserve", default="4,12")
    p.add_argument("--batch", type=int, default=256)
    a = p.parse_args()
    from infclip.train.sm_partition import tower_stream

    towers, losses, matmul = setup(a.batch)
    base = torch.cuda.current_stream()
    ref, control = results(towers, losses), results(towers, losses)
    tflops0 = rate(matmul, base) * 2 * 8192**3 / 1e12
    samples0 = rate(towers, base) * a.batch
    ms0 = {b: 1e3 / rate(fn, base) for b, fn in losses.items()}
    print(f"control, every SM twice: towers identical {same(ref['towers'], control['towers'])}, loss "
          + " / ".join(f"{b}: {same(ref[b], control[b])}" for b in LOSS_B), flush=True)
    print("| reserve | stream | matmul TFLOP/s (all SMs) | towers fwd+bwd samples/s (all SMs) | towers identical "
          "| loss 8k / 32k fwd+bwd ms (all SMs) | loss 8k / 32k identical |")
    print("|---|---|---|---|---|---|---|")
    for reserve in [int(r) for r in a.reserve.split(",")]:
        part = tower_stream("cuda", reserve)
        if part.stream is None:
            print(f"| {reserve} | {part.describe()} | | | | | |", flush=True)
            continue
        s = part.stream
        s.wait_stream(base)
        with torch.cuda.stream(s):
            got = results(towers, losses)
        base.wait_stream(s)
        tflops = rate(matmul, s) * 2 * 8192**3 / 1e12
        samples = rate(towers, s) * a.batch
        ms = " / ".join(f"{1e3 / rate(fn, s):.2f} ({ms0[b]:.2f})" for b, fn in losses.items())
        print(f"| {reserve} | {part.describe()} | {tflops:.0f} ({tflops0:.0f}) | {samples:,.0f} ({samples0:,.0f}) "
              f"| {same(got['towers'], ref['towers'])} | {ms} | "
              + " / ".join(str(same(got[b], ref[b])) for b in LOSS_B) + " |", flush=True)


if __name__ == "__main__":
    main()
