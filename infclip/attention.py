"""The towers' self-attention on ``F.scaled_dot_product_attention`` in training (``model.sdpa_attention``).

open_clip 3.3 builds its ViT and text-transformer blocks on ``nn.MultiheadAttention``. In
training mode that module runs ``F.multi_head_attention_forward``: it transposes the batch to
(L, N, D), projects, and calls SDPA with the mask it was given. The text tower passes its
causal mask as a float (L, L) tensor of 0 / -inf, and any mask tensor rules out the flash
kernels (SDPA then takes memory-efficient attention, or math). open_clip's main branch
replaces the module by its own ``Attention`` (same keys: ``in_proj_weight``, ``in_proj_bias``,
``out_proj.*``) that calls SDPA on (N, H, L, d) directly, still with the float mask.

:func:`sdpa_attention` re-classes each tower block's ``nn.MultiheadAttention`` in place as
:class:`SdpaSelfAttention` (same module, same Parameters, same state-dict keys). In training
mode its self-attention is: one packed in-projection ``F.linear(x, in_proj_weight)`` on the
(N, L, D) batch, SDPA on (N, H, L, d), and the output projection called as a module (so
``precision.fp8`` can swap it, ``infclip.fp8``). In the text tower, whose mask the re-classing
checked to be exactly the causal one, the mask is replaced by ``is_causal=True``: no mask
tensor, so flash and cuDNN attention are eligible. Outputs equal the ``nn.MultiheadAttention``
ones up to summation order (fp32: ~1e-6 relative; the causal softmax gives -inf keys weight 0
in both). Eval mode, need_weights, key-padding masks and cross-attention keep
``nn.MultiheadAttention``'s own forward (its inference fast path, numbers equal open_clip's).

:func:`sdpa_backends` reports which SDPA kernel each tower reaches, read off the PyTorch
profiler's operator names (``python -m infclip.attention --model ViT-B-32 --amp bf16``).
"""

from __future__ import annotations

import argparse
import json
from contextlib import nullcontext
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class SdpaSelfAttention(nn.MultiheadAttention):
    """``nn.MultiheadAttention`` (batch_first, self-attention) whose training-mode forward calls
    SDPA on (N, H, L, d) directly; ``causal``: a 2-D (L, L) mask given to it is the causal mask
    (set by :func:`sdpa_attention` after checking the tower's mask), passed as ``is_causal``."""

    causal: bool = False
    in_proj_fp8: Optional[nn.Module] = None  # precision.fp8: a Float8Linear sharing in_proj_weight / bias

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor] = None,
                need_weights: bool = True, attn_mask: Optional[Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False):
        if not self._own_path(query, key, value, key_padding_mask, need_weights, attn_mask):
            return super().forward(query, key, value, key_padding_mask=key_padding_mask, need_weights=need_weights,
                                   attn_mask=attn_mask, average_attn_weights=average_attn_weights,
                                   is_causal=is_causal)
        causal = self.causal and attn_mask is not None and attn_mask.ndim == 2
        return self_attention(self, query, None if causal else attn_mask, causal), None

    def _own_path(self, q, k, v, key_padding_mask, need_weights, attn_mask) -> bool:
        """Training mode, self-attention, no key-padding mask, no weights asked for, a mask of
        at most (L, L) broadcast over the batch (the causal one or none)."""
        return (self.training and q is k and k is v and self.batch_first and key_padding_mask is None
                and not need_weights and (attn_mask is None or attn_mask.ndim == 2) and q.ndim == 3)


def self_attention(mha: nn.MultiheadAttention, x: Tensor, mask: Optional[Tensor], causal: bool) -> Tensor:
    """Multi-head self-attention of x (N, L, D) with ``mha``'s weights -> (N, L, D): packed
    in-projection, SDPA on (N, H, L, D/H) (``mask``: additive (L, L) or None; ``causal``:
    SDPA's is_causal), output projection as a module call. Dropout on the attention weights
    as ``nn.MultiheadAttention`` (``mha.dropout`` in training)."""
    n, seq, dim = x.shape
    heads = mha.num_heads
    fp8 = getattr(mha, "in_proj_fp8", None)  # a plain attribute (not a submodule): no new state-dict keys
    proj = fp8(x) if fp8 is not None else F.linear(x, mha.in_proj_weight, mha.in_proj_bias)
    q, k, v = proj.view(n, seq, 3, heads, dim // heads).permute(2, 0, 3, 1, 4).unbind(0)
    if mask is not None:
        mask = mask.to(q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                         dropout_p=mha.dropout if mha.training else 0.0)
    return mha.out_proj(out.transpose(1, 2).reshape(n, seq, dim))


def reclassable(m: nn.Module) -> bool:
    """An ``nn.MultiheadAttention`` that :class:`SdpaSelfAttention` computes the same way:
    batch_first, packed equal q/k/v dims, no bias_k / bias_v, no add_zero_attn."""
    return (type(m) is nn.MultiheadAttention and m.batch_first and m._qkv_same_embed_dim
            and m.in_proj_weight is not None and m.bias_k is None and m.bias_v is None and not m.add_zero_attn)


def text_towers(model: nn.Module) -> list[tuple[str, nn.Module, Optional[Tensor]]]:
    """(name, transformer, its attention mask) of the open_clip text towers of ``model``: CLIP's
    unpacked tower (``model.transformer`` with ``model.attn_mask``) or a ``TextTransformer``
    (``model.text``) without a pad mask or class token (whose masks are per-sample)."""
    towers = []
    if isinstance(getattr(model, "transformer", None), nn.Module) and hasattr(model, "token_embedding"):
        towers.append(("transformer", model.transformer, getattr(model, "attn_mask", None)))
    text = getattr(model, "text", None)
    if text is not None and hasattr(text, "transformer") and hasattr(text, "token_embedding"):
        per_sample = getattr(text, "use_pad_mask", False) or getattr(text, "cls_emb", None) is not None
        towers.append(("text.transformer", text.transformer, None if per_sample else getattr(text, "attn_mask", None)))
    return towers


def is_causal_mask(mask: Optional[Tensor]) -> bool:
    """Whether ``mask`` is a float (L, L) mask of -inf strictly above the diagonal and 0 elsewhere."""
    if mask is None or mask.ndim != 2 or mask.shape[0] != mask.shape[1] or not mask.is_floating_point():
        return False
    upper = torch.ones(mask.shape, dtype=torch.bool, device=mask.device).triu(1)
    return bool((mask[upper] == float("-inf")).all() and (mask[~upper] == 0).all())


def sdpa_attention(model: nn.Module) -> dict[str, int]:
    """Re-class the towers' ``nn.MultiheadAttention`` modules as :class:`SdpaSelfAttention`, in
    place; those of a text tower with a causal mask get ``causal``. Returns the count per tower
    ("visual", "text", "text (causal)")."""
    counts: dict[str, int] = {}
    causal_ids = set()
    for _, tower, mask in text_towers(model):
        if is_causal_mask(mask):
            causal_ids |= {id(m) for m in tower.modules()}
    for name, m in model.named_modules():
        if reclassable(m):
            m.__class__ = SdpaSelfAttention
            m.causal = id(m) in causal_ids
            tower = "visual" if name.startswith("visual.") else "text"
            key = tower + (" (causal)" if m.causal else "")
            counts[key] = counts.get(key, 0) + 1
    return counts


# ----------------------------------------------------------------------------- which SDPA kernel runs

# profiler operator name -> backend (the fused ops SDPA dispatches to; their backward ops share the prefix)
_BACKENDS = (
    ("_scaled_dot_product_flash_attention_for_cpu", "flash (cpu)"),
    ("_scaled_dot_product_flash_attention", "flash"),
    ("_flash_attention", "flash"),
    ("_scaled_dot_product_cudnn_attention", "cudnn"),
    ("_scaled_dot_product_efficient_attention", "efficient"),
    ("_efficient_attention", "efficient"),
    ("_scaled_dot_product_fused_attention_overrideable", "overrideable"),
    ("_scaled_dot_product_attention_math", "math"),
    ("_native_multi_head_attention", "native MHA"),
)


def backends_in(names: list[str]) -> str:
    """The SDPA backends named among profiler operator ``names`` ("flash", "efficient+math", ...;
    "none" when no attention op ran, e.g. a tower without SDPA)."""
    found = []
    for name in names:
        short = name.split("::")[-1]
        for prefix, backend in _BACKENDS:
            if short.startswith(prefix):
                if backend not in found:
                    found.append(backend)
                break
    return "+".join(found) or "none"


def _ops_run(fn: Callable[[], Any]) -> list[str]:
    """Names of the operators ``fn`` ran (CPU-side profiler: every dispatched op, composite
    ones included; the kernels themselves are not needed to name the backend)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events()]


def sdpa_backends(model: nn.Module, images: Tensor, tokens: Tensor, amp: Optional[torch.dtype] = None
                  ) -> dict[str, dict[str, str]]:
    """The SDPA backend each tower reaches in the gradient cache's two passes, in training mode:
    ``cache`` (no grad), ``replay`` (forward with grad under the cache pass's RNG state) and
    ``backward``. images (B, 3, H, W) float, tokens (B, L) int64, on the model's device; ``amp``:
    the autocast dtype (None: none). Returns {"image": {...}, "text": {...}}."""
    was = model.training
    model.train()
    device = images.device
    cast = (lambda: torch.autocast(device.type, dtype=amp)) if amp is not None else nullcontext
    out: dict[str, dict[str, str]] = {}
    try:
        for tower, fn, x in (("image", model.encode_image, images), ("text", model.encode_text, tokens)):
            rng = torch.get_rng_state()
            with torch.no_grad(), cast():
                cache = backends_in(_ops_run(lambda: fn(x)))
            torch.set_rng_state(rng)
            with cast():
                box = {}
                replay = backends_in(_ops_run(lambda: box.setdefault("y", fn(x))))
            y = box["y"]
            backward = backends_in(_ops_run(lambda: y.float().pow(2).sum().backward()))
            out[tower] = {"cache": cache, "replay": replay, "backward": backward}
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was)
    return out


def main(argv: Optional[list[str]] = None) -> None:
    """Print (and with --json, write) the SDPA backend per tower and pass for an open_clip model
    built as the trainer builds it (``infclip.model.build_model``), on random inputs."""
    from infclip.config import ModelConfig
    from infclip.model import build_model

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="ViT-B-32")
    p.add_argument("--micro", type=int, default=8, help="samples per pass")
    p.add_argument("--amp", default="bf16", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--native", action="store_true", help="keep nn.MultiheadAttention (model.sdpa_attention=false)")
    p.add_argument("--json", default=None, help="also write the result to this file")
    a = p.parse_args(argv)
    built = build_model(ModelConfig(name=a.model, sdpa_attention=not a.native), device=a.device)
    size = built.image_size
    images = torch.randn(a.micro, 3, size, size, device=a.device)
    tokens = built.tokenizer(["a photo of a cat"] * a.micro).to(a.device)
    amp = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[a.amp]
    res = sdpa_backends(built.model, images, tokens, amp)
    for tower, passes in res.items():
        print(f"{a.model} {tower}: " + ", ".join(f"{k} {v}" for k, v in passes.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
