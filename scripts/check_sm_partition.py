"""Towers on a green-context stream (``data.decode_reserved_sms``): same results, what it costs.

    python scripts/check_sm_partition.py [--reserve 4,12] [--batch 256]

For each reserve it builds the partitioned stream (infclip/train/sm_partition.py) and prints
one table row: which API made it, bf16 8192^3 matmul TFLOP/s on it against every SM, and
whether a compiled ViT-B/32 forward + backward (open_clip) and the Triton CLIP loss forward +
backward (b = 8,192: replayed from CUDA graphs captured on a side stream; b = 32,768: strips)
give bit-identical results on it and on the ordinary stream, with their times.
Needs CUDA.
"""

from __future__ import annotations

import argparse
import time

import torch


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
    from infclip.loss import clip_loss

    i, t = img.detach().requires_grad_(), txt.detach().requires_grad_()
    loss = clip_loss(i, t, scale)
    loss.backward()
    return loss.detach(), [i.grad, t.grad]


def same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reserve", default="4,12")
    p.add_argument("--batch", type=int, default=256)
    a = p.parse_args()
    import open_clip

    from infclip.train.sm_partition import tower_stream

    import torch.cuda.green_contexts as g
    print("torch", torch.__version__, "GreenContext:", [n for n in dir(g.GreenContext) if not n.startswith("__")], flush=True)
    torch.manual_seed(0)
    model = open_clip.create_model("ViT-B-32").cuda()
    model.train()
    model.encode_image = torch.compile(model.encode_image)
    model.encode_text = torch.compile(model.encode_text)
    images = torch.randn(a.batch, 3, 224, 224, device="cuda")
    tokens = torch.randint(1, 49000, (a.batch, 77), device="cuda")
    feats = {b: [torch.nn.functional.normalize(torch.randn(b, 512, device="cuda"), dim=1).bfloat16() for _ in range(2)]
             for b in (8192, 32768)}
    scale = torch.tensor(14.3, device="cuda", requires_grad=True)
    mat = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    base = torch.cuda.current_stream()
    ref_tower = tower_step(model, images, tokens)
    ref_loss = {b: [loss_step(*f, scale) for _ in range(3)][-1] for b, f in feats.items()}  # eager, capture, replay
    tflops0 = rate(lambda: mat @ mat, base) * 2 * 8192**3 / 1e12
    towers0 = rate(lambda: tower_step(model, images, tokens), base) * a.batch
    loss0 = {b: 1e3 / rate(lambda: loss_step(*f, scale), base) for b, f in feats.items()}
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
            tw = tower_step(model, images, tokens)
            ls = {b: [loss_step(*f, scale) for _ in range(3)][-1] for b, f in feats.items()}
        base.wait_stream(s)
        torch.cuda.synchronize()
        tflops = rate(lambda: mat @ mat, s) * 2 * 8192**3 / 1e12
        towers = rate(lambda: tower_step(model, images, tokens), s) * a.batch
        ms = " / ".join(f"{1e3 / rate(lambda: loss_step(*f, scale), s):.2f} ({loss0[b]:.2f})" for b, f in feats.items())
        ok = " / ".join(str(same(ls[b], ref_loss[b])) for b in feats)
        print(f"| {reserve} | {part.describe()} | {tflops:.0f} ({tflops0:.0f}) | {towers:,.0f} ({towers0:,.0f}) "
              f"| {same(tw, ref_tower)} | {ms} | {ok} |", flush=True)


if __name__ == "__main__":
    main()
