"""FP8 linear layers in the towers' transformer blocks (``precision.fp8``), through torchao's float8 training.

``precision.fp8=tensorwise|rowwise`` swaps the trained ``nn.Linear`` layers inside the towers'
transformer blocks for torchao's ``Float8Linear`` (``torchao.float8.convert_to_float8_training``
with ``Float8LinearConfig.from_recipe_name``): their forward GEMM and both backward GEMMs take
e4m3 inputs (tensorwise: the gradient e5m2) scaled per tensor or per row, and write the input's
(autocast) precision. Which layers, per block (:func:`fp8_layer`):

* the MLP's ``c_fc`` and ``c_proj`` (open_clip; ``fc1`` / ``fc2`` in timm blocks),
* the attention's output projection, where the block's attention calls it as a module
  (``infclip.attention.SdpaSelfAttention``, ``model.sdpa_attention=true``; ``nn.MultiheadAttention``'s
  own forward reads its weight directly, so swapping it would change nothing),
* the attention's packed q/k/v in-projection ``in_proj_weight`` (a Parameter of
  ``nn.MultiheadAttention``, not a layer): a ``Float8Linear`` that shares the Parameter is kept as
  a plain attribute of the attention module (``in_proj_fp8``), so no state-dict key changes.

``precision.fp8_layers=large`` keeps, of those, only the layers whose GEMM is large enough for
FP8 to pay in torchao's published measurements on H100s (:func:`large_enough`): at ViT-B's
width (768) the MLP's up-projection and the q/k/v in-projection under tensorwise scaling, no
layer under rowwise. "all" (the default) converts every selected layer.

Everything else stays in bf16/fp32: patch embedding, token and position embeddings, the norms,
the final projections (``visual.proj``, ``text_projection``), the logit scale and the loss.
Locked (LiT) layers are not converted: they run once per step without gradient, and FP8 is
chosen here for the training GEMMs. Parameters, their dtypes and the state-dict keys are
unchanged (``Float8Linear`` keeps the ``weight`` / ``bias`` Parameters of the layer it replaces),
so checkpoints are interchangeable between fp8 and bf16 runs.

The conversion happens before ``model.compile`` and DDP (``infclip.train.build``); the
gradient cache's replay recomputes the same FP8 casts from the same weights (dynamic scaling
keeps no state between calls), so cache pass and replay agree as in bf16.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

RECIPES = ("off", "tensorwise", "rowwise")
LAYER_SETS = ("all", "large")
BLOCK = re.compile(r"(^|\.)(resblocks|blocks)\.\d+\.")  # a layer inside one of a tower's transformer blocks
_LAYER_NAMES = ("c_fc", "c_proj", "fc1", "fc2", "out_proj", "proj", "qkv")


def fp8_problem(recipe: str, device_type: str, capability: Optional[tuple[int, int]],
                torchao_error: Optional[str]) -> Optional[str]:
    """Why ``precision.fp8=recipe`` cannot run here (one paragraph naming the fix), or None.
    ``capability``: the training GPU's (major, minor); ``torchao_error``: why torchao's float8
    module does not import (None: it does)."""
    if recipe == "off":
        return None
    key = f"precision.fp8={recipe}"
    if device_type != "cuda":
        return (f"{key} needs a CUDA GPU with FP8 tensor cores (compute capability 8.9 or newer: L4, L40, H100, "
                f"H200, B200); this run trains on {device_type}. Set precision.fp8=off, or train on such a GPU")
    if capability is None or tuple(capability) < (8, 9):
        cc = ".".join(map(str, capability)) if capability else "unknown"
        return (f"{key} needs FP8 tensor cores (compute capability 8.9 or newer: L4, L40, H100, H200, B200); this "
                f"GPU has compute capability {cc}. Set precision.fp8=off (bf16 GEMMs), or train on such a GPU")
    if torchao_error:
        return (f"{key} trains through torchao's float8 training, which does not import here ({torchao_error}). "
                "Install torchao matching your torch (pip install torchao), or set precision.fp8=off")
    return None


def torchao_import_error() -> Optional[str]:
    """None when ``torchao.float8`` imports, else the error in one phrase."""
    try:
        import torchao.float8  # noqa: F401
    except Exception as e:  # ImportError, or an ABI mismatch with this torch
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
    return None


def check_fp8(recipe: str, device: torch.device) -> Optional[str]:
    """:func:`fp8_problem` for this process's training device."""
    if recipe == "off":
        return None
    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" and torch.cuda.is_available() else None
    return fp8_problem(recipe, device.type, cap, torchao_import_error())


def fp8_layer(module: nn.Module, fqn: str) -> bool:
    """Whether the layer ``fqn`` of a model runs in FP8: an ``nn.Linear`` (torchao's swap
    target) inside a transformer block (``...resblocks.N.`` / ``...blocks.N.``), named as an MLP
    or attention projection, trained (weight requires grad), both sides multiples of 16
    (FP8 GEMM alignment); an attention output projection only where the attention calls it as a
    module (``SdpaSelfAttention``)."""
    if not isinstance(module, nn.Linear) or not BLOCK.search(fqn + "."):
        return False
    if fqn.rsplit(".", 1)[-1] not in _LAYER_NAMES or not module.weight.requires_grad:
        return False
    if module.in_features % 16 or module.out_features % 16:
        return False
    return True


def large_enough(recipe: str, in_features: int, out_features: int) -> bool:
    """Whether a (out_features x in_features) weight's GEMMs are large enough for ``recipe`` to
    beat bf16 by torchao's size rules (its float8 README's H100 tables: at smaller shapes the
    casts and scales cost more than the FP8 tensor cores save): tensorwise unless both
    in_features <= 4096 and out_features <= 1024; rowwise when out_features > 2048,
    in_features > 1024 and not both out_features <= 4096 and in_features <= 2048."""
    if recipe == "tensorwise":
        return not (in_features <= 4096 and out_features <= 1024)
    if recipe == "rowwise":
        return out_features > 2048 and in_features > 1024 and not (out_features <= 4096 and in_features <= 2048)
    raise ValueError(f"no FP8 size rule for recipe {recipe!r}")


@dataclass
class Fp8Layers:
    """What :func:`convert_towers` swapped: qualified names, in model order."""

    recipe: str
    layers: list[str] = field(default_factory=list)  # Float8Linear modules (state-dict names unchanged)
    in_projs: list[str] = field(default_factory=list)  # attention modules whose in-projection runs in FP8
    which: str = "all"  # precision.fp8_layers

    def line(self) -> str:
        """The startup line: the recipe, how many GEMM layers run in FP8 and their name patterns."""
        if self.recipe == "off":
            return "precision: fp8=off (every GEMM in the autocast/parameter precision)"
        names = self.layers + [f"{n}.in_proj" for n in self.in_projs]
        patterns = sorted({re.sub(r"\.\d+\.", ".N.", n) for n in names})
        which = "" if self.which == "all" else f", fp8_layers={self.which} (the GEMMs large enough for FP8 to pay)"
        none = "" if names else (f" (no layer of this model passes; set precision.fp8=off, or precision.fp8_layers=all "
                                 "to convert them anyway)")
        return (f"precision: fp8={self.recipe} (torchao float8 training{which}) in {len(names)} linear layers of the "
                f"towers' transformer blocks: {', '.join(patterns) or 'none'}{none}; embeddings, norms, final "
                "projections, logit scale and loss stay bf16/fp32")


def _module_filter(model: nn.Module, recipe: str = "tensorwise", which: str = "all"):
    from infclip.attention import SdpaSelfAttention

    # nn.MultiheadAttention's own forward reads out_proj.weight: a swap would change nothing there
    unused = {id(m.out_proj) for m in model.modules()
              if isinstance(m, nn.MultiheadAttention) and not isinstance(m, SdpaSelfAttention)}

    def keep(module: nn.Module, fqn: str) -> bool:
        if id(module) in unused or not fp8_layer(module, fqn):
            return False
        return which == "all" or large_enough(recipe, module.in_features, module.out_features)

    return keep


def convert_towers(model: nn.Module, recipe: str, which: str = "all") -> Fp8Layers:
    """Swap the layers :func:`fp8_layer` selects for torchao ``Float8Linear`` (recipe
    "tensorwise" | "rowwise"), in place, and give each trained ``SdpaSelfAttention`` in a block
    an FP8 in-projection sharing its Parameters; ``which="large"``: only the layers (and
    in-projections) :func:`large_enough` for the recipe. Call before compile and DDP wrap the model."""
    if which not in LAYER_SETS:
        raise ValueError(f"precision.fp8_layers must be one of {LAYER_SETS}, got {which!r}")
    out = Fp8Layers(recipe, which=which)
    if recipe == "off":
        return out
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    keep = _module_filter(model, recipe, which)
    out.layers = [n for n, m in model.named_modules() if keep(m, n)]
    if out.layers:
        convert_to_float8_training(model, module_filter_fn=keep, config=config)
    out.in_projs = _fp8_in_projections(model, config, None if which == "all" else recipe)
    return out


def _fp8_in_projections(model: nn.Module, config: Any, size_rule: Optional[str] = None) -> list[str]:
    """FP8 in-projections for the trained ``SdpaSelfAttention`` modules inside blocks: a
    ``Float8Linear`` whose weight / bias are the module's ``in_proj_weight`` / ``in_proj_bias``
    (the same Parameters), set with ``object.__setattr__`` so it is no submodule. ``size_rule``:
    a recipe whose :func:`large_enough` the (3 width x width) GEMM must pass (None: any size)."""
    from torchao.float8.float8_linear import Float8Linear

    from infclip.attention import SdpaSelfAttention

    names = []
    for name, m in model.named_modules():
        w = getattr(m, "in_proj_weight", None)
        if not isinstance(m, SdpaSelfAttention) or w is None or not BLOCK.search(name + "."):
            continue
        if not w.requires_grad or w.shape[0] % 16 or w.shape[1] % 16:
            continue
        if size_rule is not None and not large_enough(size_rule, w.shape[1], w.shape[0]):
            continue
        with torch.device("meta"):
            shell = nn.Linear(w.shape[1], w.shape[0], bias=False)
        shell.weight, shell.bias = w, m.in_proj_bias
        object.__setattr__(m, "in_proj_fp8", Float8Linear.from_float(shell, config=config))
        names.append(name)
    return names


def fp8_modules(model: nn.Module) -> list[str]:
    """Qualified names of the Float8Linear modules of ``model`` (plus ``<attn>.in_proj`` for FP8
    in-projections): what runs in FP8 now."""
    names = [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"]
    names += [f"{n}.in_proj" for n, m in model.named_modules() if getattr(m, "in_proj_fp8", None) is not None]
    return names
