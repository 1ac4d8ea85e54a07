"""LiT (locked-image tuning): lock towers, split them into a locked trunk and a trainable head.

``apply_locks(model, model_cfg)`` freezes the configured towers with open_clip's own
``lock_image_tower`` / ``lock_text_tower`` (requires_grad=False: such parameters never
enter the optimizer, so they have no optimizer state and no weight decay), pins the locked
modules in eval mode (no dropout, no BN-statistic updates, whatever ``model.train()``
says) and returns a :class:`LockPlan` that tells the step engine how to run each tower:

* ``"train"``: an ordinary tower (or a locked one we cannot split; its locked part then
  runs in eval mode but is re-encoded in pass 2).
* ``"frozen"``: every parameter is locked (the paper's LiT setting, ViT-B/16 image tower
  with ``lock_image_unlocked_groups=0``). Pass 1 encodes it once and caches its
  normalized embeddings; pass 2 never runs it.
* ``"split"``: a locked trunk and a trainable head. Pass 1 runs the trunk once and caches
  its features on the device; both passes run only the head on them (``head_only``).
  Supported splits: open_clip ``VisionTransformer`` (any ``lock_image_unlocked_groups``:
  the trunk ends before the first unlocked group), a timm trunk with open_clip's
  projection head (``TimmModel``, fully locked trunk), a Hugging Face text encoder with a
  locked transformer (``HFTextEncoder``: trunk = transformer + pooler, head = proj), the
  text tower of an open_clip ``CLIP`` (any ``lock_text_unlocked_layers``).
  Trunk features are (micro, tokens, width) for a ViT split inside the blocks, (micro,
  width) for a split at the projection.

Layering: imports torch and open_clip only; the engine imports this module.
"""

from __future__ import annotations

import types
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class TowerPlan:
    """How the engine runs one tower (see the module docs for the modes)."""

    mode: str = "train"  # "train" | "frozen" | "split"
    trunk: Optional[Callable[[Tensor], Tensor]] = None  # split: tower input -> trunk features
    head: Optional[Callable[[Tensor], Tensor]] = None  # split: trunk features -> embedding
    module: Optional[nn.Module] = None  # split: the module whose method the head replaces
    attr: str = "forward"  # split: that method ("encode_text" for CLIP's unpacked text tower)
    locked: list = field(default_factory=list)  # modules pinned in eval mode


@dataclass
class LockPlan:
    image: TowerPlan = field(default_factory=TowerPlan)
    text: TowerPlan = field(default_factory=TowerPlan)

    @contextmanager
    def head_only(self) -> Iterator[None]:
        """Inside, a split tower's forward takes trunk features and runs only its head.

        Implemented as an instance-level ``forward`` override so that the model's own
        forward (and DistributedDataParallel's hooks around it) run unchanged; state dict
        keys are untouched.
        """
        towers = [t for t in (self.image, self.text) if t.mode == "split"]
        for t in towers:
            object.__setattr__(t.module, t.attr, t.head)
        try:
            yield
        finally:
            for t in towers:
                object.__delattr__(t.module, t.attr)


# ----------------------------------------------------------------------------- public


def apply_locks(model: nn.Module, model_cfg: Any) -> LockPlan:
    """Freeze the towers ``model_cfg`` locks, pin them in eval mode, return the plan.

    Args:
        model: an open_clip ``CLIP`` / ``CustomTextCLIP`` (not DDP-wrapped).
        model_cfg: ``ModelConfig`` (lock_image, lock_image_unlocked_groups, lock_text,
            lock_text_unlocked_layers).
    """
    if model_cfg.lock_image:
        model.lock_image_tower(unlocked_groups=model_cfg.lock_image_unlocked_groups, freeze_bn_stats=True)
    if model_cfg.lock_text:
        model.lock_text_tower(unlocked_layers=model_cfg.lock_text_unlocked_layers)
    plan = lock_plan(model, model_cfg)
    for tower in (plan.image, plan.text):
        for m in tower.locked:
            pin_eval(m)
    return plan


def lock_plan(model: nn.Module, model_cfg: Any) -> LockPlan:
    """The plan for an already-locked model (pure: reads requires_grad, changes nothing)."""
    plan = LockPlan()
    if model_cfg.lock_image:
        plan.image = _image_plan(model.visual)
    if model_cfg.lock_text:
        plan.text = _text_plan(model)
    return plan


def pin_eval(module: nn.Module) -> None:
    """Keep ``module`` (and its children) in eval mode even when ``model.train()`` is called."""
    module.train = types.MethodType(_train_locked, module)
    nn.Module.train(module, False)


def _train_locked(self: nn.Module, mode: bool = True) -> nn.Module:
    return nn.Module.train(self, False)


def frozen(params) -> bool:
    return all(not p.requires_grad for p in params)


# ----------------------------------------------------------------------------- image


def _image_plan(visual: nn.Module) -> TowerPlan:
    if frozen(visual.parameters()):
        return TowerPlan("frozen", locked=[visual])
    from open_clip.transformer import VisionTransformer

    if isinstance(visual, VisionTransformer):
        return _vit_plan(visual)
    trunk, head = getattr(visual, "trunk", None), getattr(visual, "head", None)
    if isinstance(trunk, nn.Module) and isinstance(head, nn.Module) and frozen(trunk.parameters()):
        return TowerPlan(  # TimmModel: forward is head(trunk(x))
            "split", trunk=lambda x: trunk(x), head=lambda f: head(f), module=visual, locked=[trunk]
        )
    return _fallback(visual)


def _vit_units(v: nn.Module) -> list[tuple[str, list]]:
    """open_clip's lock groups in forward order: embeds, blocks..., ln_post, proj."""
    embeds = [v.conv1, v.class_embedding, v.positional_embedding, v.ln_pre]
    blocks = [("block", [b]) for b in v.transformer.resblocks]
    return [("embeds", embeds), *blocks, ("ln_post", [v.ln_post]), ("proj", [v.proj])]


def _params(items: Sequence) -> list:
    out = []
    for x in items:
        out += [x] if isinstance(x, nn.Parameter) else list(x.parameters()) if isinstance(x, nn.Module) else []
    return out


def _vit_plan(v: nn.Module) -> TowerPlan:
    units = _vit_units(v)
    first = next(i for i, (_, items) in enumerate(units) if not frozen(_params(items)))
    if first == 0 or v.attn_pool is not None or v.output_tokens or not v.transformer.batch_first:
        return _fallback(v)
    n_blocks = len(v.transformer.resblocks)
    locked = [v.conv1, v.ln_pre, v.patch_dropout, *v.transformer.resblocks[: min(first - 1, n_blocks)]]
    if units[first][0] == "proj":  # trunk ends at the pooled features
        return TowerPlan(
            "split", trunk=lambda x: v._pool(v.transformer(v._embeds(x)))[0],
            head=lambda f: f @ v.proj, module=v, locked=locked + [v.ln_post],
        )
    cut = first - 1  # blocks [0, cut) are locked; cut == n_blocks: only ln_post/proj train
    return TowerPlan(
        "split", trunk=lambda x: _blocks(v.transformer.resblocks[:cut], v._embeds(x)),
        head=lambda f: _vit_head(v, cut, f), module=v, locked=locked,
    )


def _blocks(blocks: Sequence[nn.Module], x: Tensor, attn_mask: Optional[Tensor] = None) -> Tensor:
    for blk in blocks:
        x = blk(x, attn_mask=attn_mask)
    return x


def _vit_head(v: nn.Module, cut: int, x: Tensor) -> Tensor:
    """VisionTransformer.forward from block ``cut`` on (batch-first tokens in)."""
    pooled, _ = v._pool(_blocks(v.transformer.resblocks[cut:], x))
    return pooled @ v.proj if v.proj is not None else pooled


# ----------------------------------------------------------------------------- text


def _text_parts(model: nn.Module) -> list:
    """The text tower's modules/parameters (CLIP unpacks them onto the model)."""
    if hasattr(model, "text"):
        return [model.text]
    names = ("token_embedding", "positional_embedding", "transformer", "ln_final", "text_projection")
    return [getattr(model, n) for n in names if getattr(model, n, None) is not None]


def _text_plan(model: nn.Module) -> TowerPlan:
    parts = _text_parts(model)
    if frozen(_params(parts)):
        return TowerPlan("frozen", locked=[p for p in parts if isinstance(p, nn.Module)])
    text = getattr(model, "text", None)
    hf = text is not None and all(hasattr(text, a) for a in ("transformer", "pooler", "proj"))
    if hf and frozen(text.transformer.parameters()) and frozen(text.pooler.parameters()):
        return TowerPlan(
            "split", trunk=lambda t: _hf_trunk(text, t), head=lambda f: text.proj(f), module=text,
            locked=[text.transformer, text.pooler],
        )
    if text is None and model.transformer.batch_first:
        return _clip_text_plan(model)
    return _fallback(*[p for p in parts if isinstance(p, nn.Module)])


def _clip_text_plan(model: nn.Module) -> TowerPlan:
    """open_clip ``CLIP`` (text tower unpacked onto the model): split at the first unlocked
    group of [embeddings, blocks..., ln_final, text_projection]. Trunk features are
    (tokens after the locked blocks, token ids) -- the ids are needed for EOT pooling."""
    blocks = model.transformer.resblocks
    units = [[model.token_embedding, model.positional_embedding], *[[b] for b in blocks],
             [model.ln_final], [model.text_projection]]
    first = next(i for i, items in enumerate(units) if not frozen(_params(items)))
    if first == 0:
        return _fallback(model.token_embedding, model.transformer, model.ln_final)
    cut = min(first - 1, len(blocks))  # blocks [0, cut) are locked
    locked = [model.token_embedding, *blocks[:cut]] + ([model.ln_final] if first > len(blocks) + 1 else [])
    return TowerPlan(
        "split", trunk=lambda t: _clip_text_trunk(model, cut, t),
        head=lambda f, normalize=False: _clip_text_head(model, cut, f, normalize),
        module=model, attr="encode_text", locked=locked,
    )


def _clip_text_trunk(model: nn.Module, cut: int, tokens: Tensor) -> tuple[Tensor, Tensor]:
    cast = model.transformer.get_cast_dtype()
    x = model.token_embedding(tokens).to(cast) + model.positional_embedding.to(cast)
    return _blocks(model.transformer.resblocks[:cut], x, model.attn_mask), tokens


def _clip_text_head(model: nn.Module, cut: int, feats: tuple, normalize: bool) -> Tensor:
    """``CLIP.encode_text`` from block ``cut`` on."""
    from open_clip.transformer import text_global_pool

    x, tokens = feats
    x = model.ln_final(_blocks(model.transformer.resblocks[cut:], x, model.attn_mask))
    x = text_global_pool(x, tokens, model.text_pool_type, eos_token_id=getattr(model, "text_eos_id", None))
    proj = model.text_projection
    if proj is not None:
        x = proj(x) if isinstance(proj, nn.Linear) else x @ proj
    return F.normalize(x, dim=-1) if normalize else x


def _hf_trunk(text: nn.Module, tokens: Tensor) -> Tensor:
    """HFTextEncoder.forward up to (excluding) the projection: (b, hidden) pooled features."""
    mask = (tokens != text.config.pad_token_id).long()
    return text.pooler(text.transformer(input_ids=tokens, attention_mask=mask), mask)


# ----------------------------------------------------------------------------- fallback


def _fallback(*modules: nn.Module) -> TowerPlan:
    """Partly locked tower we cannot split: pin its fully locked submodules in eval mode."""
    return TowerPlan("train", locked=[m for root in modules for m in _maximal_frozen(root)])


def _maximal_frozen(m: nn.Module) -> list[nn.Module]:
    params = list(m.parameters())
    if params and frozen(params):
        return [m]
    return [x for c in m.children() for x in _maximal_frozen(c)]
