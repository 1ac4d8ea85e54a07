"""Model construction through open_clip's factory.

Any open_clip model name works (``ViT-B-32``, ``ViT-B-16``, timm/HF towers via their
configs), plus the tiny configs shipped in ``infclip/model_configs`` and a user JSON
file (``model.config_file``). ``model.pretrained`` may be an open_clip tag (downloaded by
open_clip, never in tests) or a local checkpoint file; open_clip loads it strictly.
``model.image_pretrained`` (LiT) is loaded here, strictly: open_clip would catch a load error
and load with ``strict=False``, training a random tower from a file whose keys match nothing.

Every failure to build or load is a :class:`ModelError` (a ``ConfigError``): one paragraph
naming the key, the file and what did not match.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import open_clip
import torch

from infclip.config import ConfigError
from infclip.attention import sdpa_attention
from infclip.patch_embed import patchify_as_matmul

_CONFIG_DIR = Path(__file__).parent / "model_configs"
open_clip.add_model_config(_CONFIG_DIR)


@dataclass
class BuiltModel:
    """What the trainer and the eval hooks need from one model."""

    model: torch.nn.Module  # open_clip CLIP / CustomTextCLIP
    tokenizer: Callable[[list[str]], torch.Tensor]  # list of captions -> (N, L) int64
    image_size: int  # input side in pixels
    mean: tuple[float, ...]  # per-channel normalization mean
    std: tuple[float, ...]  # per-channel normalization std
    preprocess_val: Callable[[Any], torch.Tensor]  # PIL -> normalized float (open_clip's val transform)
    name: str = ""  # the open_clip model name it was built from (a config file's stem for model.config_file)


class ModelError(ConfigError):
    """The model or its weights cannot be built as configured; the message names the key and the file."""


def register_config_file(path: str) -> str:
    """Register a custom open_clip JSON config; returns the model name (the file stem)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ModelError(f"model.config_file={path!r} does not exist; give a path to an open_clip JSON config")
    open_clip.add_model_config(p)
    return p.stem


def _check_name(name: str) -> None:
    if open_clip.get_model_config(name) is None and not name.startswith("hf-hub:"):
        import difflib

        near = difflib.get_close_matches(name, open_clip.list_models(), n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(near)}?" if near else "open_clip.list_models() lists them"
        raise ModelError(
            f"model.name={name!r} is not an open_clip model config; {hint} "
            "(or pass model.config_file=/path/to/config.json for a custom one)"
        )


def _check_pretrained(pretrained: str | None, key: str) -> None:
    looks_like_path = pretrained and (os.sep in pretrained or pretrained.endswith((".pt", ".pth", ".bin", ".safetensors")))
    if looks_like_path and not os.path.isfile(os.path.expanduser(pretrained)):
        raise ModelError(f"{key}={pretrained!r} is not a file; give an existing checkpoint or an open_clip tag")


class _RandomInitNote(logging.Filter):
    """Drops open_clip's "No pretrained weights loaded ... initialized randomly" warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "initialized randomly" not in record.getMessage()


@contextlib.contextmanager
def _quiet_random_init(quiet: bool) -> Iterator[None]:
    """Without model.pretrained a random init is what was asked for, and a resume loads its
    weights right after: open_clip's warning that it initialized randomly (printed before
    "resumed from ...") would only mislead. Other warnings pass."""
    if not quiet:
        yield
        return
    note = _RandomInitNote()
    logging.getLogger().addFilter(note)
    try:
        yield
    finally:
        logging.getLogger().removeFilter(note)


def build_model(cfg: Any, device: torch.device | str = "cpu") -> BuiltModel:
    """Builds the open_clip model named by ``cfg`` (a ModelConfig) on ``device``, in fp32."""
    name = register_config_file(cfg.config_file) if cfg.config_file else cfg.name
    _check_name(name)
    _check_pretrained(cfg.pretrained, "model.pretrained")
    _check_pretrained(cfg.image_pretrained, "model.image_pretrained")
    kwargs: dict[str, Any] = {"force_patch_dropout": cfg.patch_dropout}  # 0.0 overrides a JSON config's value
    if cfg.image_size is not None:  # open_clip interpolates pretrained position embeddings to it
        kwargs["force_image_size"] = cfg.image_size
    if cfg.init_logit_bias is not None:
        kwargs["init_logit_bias"] = cfg.init_logit_bias
    # preprocessing overrides: model.visual.preprocess_cfg, preprocess_val and the export follow them
    for key in ("image_mean", "image_std", "image_interpolation", "image_resize_mode"):
        value = getattr(cfg, key, None)
        if value is not None:
            kwargs[key] = tuple(value) * (3 if len(value) == 1 else 1) if key in ("image_mean", "image_std") else value
    try:
        with _quiet_random_init(not cfg.pretrained):
            model, _, preprocess_val = open_clip.create_model_and_transforms(
                name, pretrained=cfg.pretrained, device=device, output_dict=True, **kwargs)
    except Exception as e:  # a tag unknown or not downloadable, a file that does not load or fit
        if not cfg.pretrained:
            raise
        raise ModelError(f"model.pretrained={cfg.pretrained!r} cannot be loaded into model.name={name!r} "
                         f"({_first_line(e)}); give an open_clip tag of that model "
                         f"({open_clip.list_pretrained_tags_by_model(name) or 'it has none'}) or a checkpoint "
                         "file of the same architecture") from e
    _check_patch_dropout(model, cfg.patch_dropout, name)
    if cfg.image_pretrained:
        load_image_tower(model, cfg.image_pretrained, name)
    if cfg.init_logit_scale is not None:
        with torch.no_grad():
            model.logit_scale.fill_(cfg.init_logit_scale)
    if cfg.grad_checkpointing:
        model.set_grad_checkpointing(True)
    if cfg.patch_embed_matmul:
        patchify_as_matmul(model)
    if getattr(cfg, "sdpa_attention", False):
        sdpa_attention(model)
    pp = model.visual.preprocess_cfg
    size = pp["size"] if isinstance(pp["size"], int) else pp["size"][0]
    return BuiltModel(model, open_clip.get_tokenizer(name), size, tuple(pp["mean"]), tuple(pp["std"]), preprocess_val,
                      name)


def _check_patch_dropout(model: torch.nn.Module, prob: float, name: str) -> None:
    """model.patch_dropout > 0 needs an image tower with open_clip's PatchDropout (a ViT); a timm
    or other tower would silently ignore it."""
    if prob == 0:
        return
    from open_clip.transformer import PatchDropout

    if not any(isinstance(m, PatchDropout) and m.prob == prob for m in model.visual.modules()):
        raise ModelError(f"model.patch_dropout={prob}: the image tower of model.name={name!r} "
                         f"({type(model.visual).__name__}) has no open_clip PatchDropout, so no patch would be "
                         "dropped; use an open_clip ViT (e.g. ViT-B-16) or set model.patch_dropout=0")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__


def load_image_tower(model: torch.nn.Module, path: str, name: str) -> None:
    """Loads ``model.image_pretrained`` into ``model.visual`` strictly: every tensor of the tower
    from the file, with its shape, and nothing else. The file holds the tower's own state dict
    or a whole CLIP's (its ``visual.`` keys are used). Anything else is refused (ModelError)."""
    key = "model.image_pretrained"
    try:
        state = open_clip.factory.load_state_dict(os.path.expanduser(path), device="cpu", weights_only=True)
    except Exception as e:  # not a checkpoint, refused unpickling, empty
        raise ModelError(f"{key}={path!r} cannot be loaded ({_first_line(e)}); give a weights-only state dict "
                         "file (torch.save(visual.state_dict()) or .safetensors) of the image tower") from e
    if any(k.startswith("visual.") for k in state):  # a whole CLIP checkpoint: its image tower
        state = {k[len("visual."):]: v for k, v in state.items() if k.startswith("visual.")}
    problem = _mismatch(model.visual.state_dict(), state)
    if problem:
        raise ModelError(f"{key}={path!r} does not fit the image tower of model.name={name!r}: {problem}; "
                         "give that tower's own state dict, or a whole CLIP checkpoint of the same "
                         "architecture (its visual.* keys are used)")
    model.visual.load_state_dict(state, strict=True)


def _mismatch(want: dict, got: dict) -> str:
    """'' when ``got`` has exactly ``want``'s keys and shapes; else what differs, in one phrase."""
    missing = [k for k in want if k not in got]
    extra = [k for k in got if k not in want]
    shapes = [f"{k}: file {tuple(got[k].shape)}, tower {tuple(want[k].shape)}" for k in want
              if k in got and tuple(got[k].shape) != tuple(want[k].shape)]
    parts = []
    if missing:
        parts.append(f"{len(missing)} of the tower's {len(want)} tensors are not in the file (e.g. {missing[:3]})")
    if extra:
        parts.append(f"{len(extra)} keys of the file match nothing in the tower (e.g. {extra[:3]})")
    if shapes:
        parts.append(f"{len(shapes)} have other shapes (e.g. {shapes[0]})")
    return "; ".join(parts)


def clamp_logit_scale(model: torch.nn.Module, max_value: float = math.log(100)) -> None:
    """CLIP's clamp of the learnable temperature, applied after each optimizer step."""
    with torch.no_grad():
        model.logit_scale.clamp_(0, max_value)


def compile_towers(model: torch.nn.Module, **compile_kw: Any) -> list[str]:
    """``torch.compile`` each tower in place (``nn.Module.compile``: the module keeps its
    parameters and state-dict keys, so checkpoints, DDP, LiT locks and the gradient-cache
    replay see the same module). Returns the names of the compiled submodules.

    The towers, not the whole model, are compiled so that every way the engine runs them is
    compiled: ``model(image=..., text=...)`` and ``encode_image`` of a frozen LiT tower alike.
    Graphs are specialised on grad mode and autocast, so the cache pass (no grad) and the
    replay (grad) each compile once; the trainer's eval hook runs them eagerly
    (``infclip.train.evaluation.eager_compiled_code``).
    ``compile_kw`` go to ``torch.compile`` (e.g. ``backend``; inductor by default).
    """
    names = [n for n in ("visual", "transformer", "text") if isinstance(getattr(model, n, None), torch.nn.Module)]
    if not names:
        raise ValueError(f"model.compile=true: {type(model).__name__} has no visual/text tower to compile")
    for n in names:
        getattr(model, n).compile(**compile_kw)
    return names
