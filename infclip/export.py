"""open_clip's own checkpoint format: ``open_clip_config.json`` + ``open_clip_model.safetensors``.

A folder holding these two files loads with open_clip alone, no import of infclip:

    open_clip.create_model_and_transforms("local-dir:runs/x/checkpoints/step_00000400")
    clip_benchmark eval --model local-dir:runs/x/checkpoints/step_00000400 ...

(the layout open_clip's ``push_to_hf_hub`` uploads, so the folder can also be pushed to the
Hugging Face Hub as it is). The config is ``{"model_cfg": <the open_clip model config the
weights were built with>, "preprocess_cfg": {mean, std, interpolation, resize_mode}}`` plus
``"model_name"`` (ours; open_clip ignores it). HF-tokenizer models also get their tokenizer
files, which open_clip reads from the same folder.

The trainer writes both files into every checkpoint folder before it is published
(``checkpoint.open_clip_export``, default true; the safetensors copy doubles the folder's
weight bytes). For an existing checkpoint:

    python -m infclip.export RUN_DIR [--step N] --out DIR

Every file read from a checkpoint folder here (and by ``python -m infclip.eval``) is first
verified against the folder's ``manifest.json`` (``verify_loaded_files``): a damaged newest
checkpoint of a run is named in one warning line, set aside as ``step_N.damaged`` and the
previous intact one used; a damaged folder named explicitly is refused.

This module never imports ``infclip.train``.
"""

from __future__ import annotations

import argparse
import copy
import errno
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

import torch

CONFIG_NAME = "open_clip_config.json"  # open_clip.constants.HF_CONFIG_NAME
WEIGHTS_NAME = "open_clip_model.safetensors"  # open_clip.constants.HF_SAFE_WEIGHTS_NAME
_PREPROCESS_KEYS = ("mean", "std", "interpolation", "resize_mode")  # what open_clip's save_config_for_hf writes
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_TOKENIZER_FILES = ("special_tokens_map.json", "vocab.json", "vocab.txt", "merges.txt", "spiece.model",
                    "sentencepiece.bpe.model", "added_tokens.json")  # what HF tokenizers' save_pretrained writes


class ExportError(ValueError):
    """A checkpoint cannot be exported; the message names the path or option and the fix."""


# -- which files are read, verified ------------------------------------------------------------


def open_clip_files(folder: Path) -> list[str]:
    """Names of open_clip's files in a checkpoint folder (config, weights, HF tokenizer files)."""
    names = sorted(os.listdir(folder)) if Path(folder).is_dir() else []
    return [n for n in names if n in (CONFIG_NAME, WEIGHTS_NAME) or n in _TOKENIZER_FILES
            or (n.startswith("tokenizer") and not n.endswith(".tmp"))]


def loaded_files(folder: Path) -> tuple[str, ...]:
    """What the eval command or the export may read from a checkpoint folder: ``model.pt``
    and open_clip's files (they build the model when present). Not the training state."""
    return ("model.pt", *open_clip_files(folder))


def verify_loaded_files(folder: Path) -> Optional[str]:
    """None when every file of ``loaded_files`` matches the folder's manifest (and is listed
    in it); else one phrase naming the file. An older folder without a manifest passes."""
    from infclip.manifest import verify

    files = loaded_files(folder)
    return verify(folder, need=files, only=files)


def newest_intact(root: Path, warn: Callable[[str], None]) -> Optional[Path]:
    """Newest ``step_N`` folder of ``root`` whose loaded files verify. Each newer one that
    does not is named in one ``warn`` line; one whose bytes changed is set aside as
    ``step_N.damaged``. One whose files vanished (pruned meanwhile by a training writing into
    the run folder) is only skipped, and the folder is listed again: the checkpoint that
    replaced it is newer, and the older ones may have been pruned too."""
    from infclip.manifest import set_aside, vanished

    tried: set[str] = set()
    while True:
        steps = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name) and p.name not in tried
                 and (p / "model.pt").is_file()]
        if not steps:
            return None
        step = max(steps, key=lambda p: int(p.name[5:]))
        problem = verify_loaded_files(step)
        if problem is None:
            return step
        tried.add(step.name)
        if vanished(problem):
            warn(f"warning: checkpoint {step} was removed while it was verified ({problem}; pruned by a "
                 "training in that run folder?): using the newest remaining intact one")
            continue
        aside = set_aside(step)
        moved = f"; moved aside to {aside.name}" if aside else ""
        warn(f"warning: skipping damaged checkpoint {step}: {problem}{moved}, falling back to the previous one")


# -- the files ---------------------------------------------------------------------------------


def model_config(name: str, init_logit_bias: Optional[float] = None, image_size: Optional[int] = None) -> dict:
    """The open_clip model config of a registered model name (+ constructor kwargs we pass).

    ``name`` must be known to open_clip (a built-in, or registered by ``infclip.model``);
    ``hf-hub:`` names use the config open_clip cached when the model was built.
    ``image_size`` (model.image_size) replaces ``vision_cfg.image_size``: the weights' position
    embeddings have that grid. model.patch_dropout is never recorded: it is a training-time
    regularizer (a no-op in eval), and recording it would turn it on for whoever fine-tunes
    the export with open_clip.
    """
    import open_clip

    if name.startswith("hf-hub:"):
        from open_clip.factory import _get_hf_config

        cfg = copy.deepcopy(_get_hf_config(name[len("hf-hub:"):])["model_cfg"])
    else:
        cfg = open_clip.get_model_config(name)
    if cfg is None:
        raise ExportError(f"model {name!r} has no open_clip config; register it (model.config_file=...) "
                          "or set checkpoint.open_clip_export=false")
    if init_logit_bias is not None:  # a constructor argument: the weights hold logit_bias
        cfg["init_logit_bias"] = init_logit_bias
    if image_size is not None:  # open_clip's force_image_size: the config the weights were built with
        cfg["vision_cfg"] = {**cfg.get("vision_cfg", {}), "image_size": image_size}
    return cfg


def preprocess_config(model: torch.nn.Module) -> dict:
    """The model's inference preprocessing, as open_clip's ``save_config_for_hf`` records it."""
    pp = getattr(model.visual, "preprocess_cfg", {})
    return {k: (list(pp[k]) if isinstance(pp[k], tuple) else pp[k]) for k in _PREPROCESS_KEYS if k in pp}


def _untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors; tensors sharing storage are copied (safetensors refuses them)."""
    out, seen = {}, set()
    for key, t in state.items():
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr() if t.numel() else None
        if ptr is not None and ptr in seen:
            t = t.clone()
        seen.add(ptr)
        out[key] = t
    return out


def _new_file_mode() -> int:
    """The mode ``open()`` gives a new file under this process's umask (0644 under 022), read
    from /proc where it exists (setting the umask to read it would race other threads)."""
    try:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("Umask:"))
        return 0o666 & ~int(line.split()[1], 8)
    except (OSError, StopIteration, ValueError):
        return 0o644


def _fsync_write(path: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)``, fsync, rename into place; the file gets the mode of any other file the
    run writes (safetensors creates its files 0600 whatever the umask)."""
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.chmod(tmp, _new_file_mode())
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_open_clip_files(folder: Path, model_state: dict, model_cfg: dict, preprocess_cfg: dict,
                          model_name: str, tokenizer: Any = None) -> None:
    """Write open_clip_config.json and open_clip_model.safetensors (and HF tokenizer files) into
    ``folder``. Each file is written to a temporary name, fsynced and renamed into place."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = {"model_cfg": model_cfg, "preprocess_cfg": preprocess_cfg, "model_name": model_name}
    _fsync_write(folder / WEIGHTS_NAME, lambda p: save_file(_untied(model_state), str(p), metadata={"format": "pt"}))
    _fsync_write(folder / CONFIG_NAME, lambda p: p.write_text(json.dumps(config, indent=2) + "\n"))
    if model_cfg.get("text_cfg", {}).get("hf_tokenizer_name") and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(str(folder))  # local-dir: open_clip reads the HF tokenizer from the folder


def checkpoint_writer(built: Any, model_cfg: Any, enabled: bool = True) -> Optional[Callable[[Path, dict], None]]:
    """The trainer's hook (``Checkpointer(on_publish=...)``): writes the open_clip files of
    ``model_state`` into a checkpoint's temporary folder before it is published (rank 0 only).

    built: infclip.model.BuiltModel; model_cfg: the run's ModelConfig. None when disabled or when
    the model is not an open_clip CLIP (SimCLR's image tower + head).
    """
    import open_clip

    if not enabled or not isinstance(built.model, (open_clip.CLIP, open_clip.CustomTextCLIP)):
        return None
    name = built.name
    cfg = model_config(name, getattr(model_cfg, "init_logit_bias", None),  # fails at startup, not at a save
                       getattr(model_cfg, "image_size", None))
    preprocess = preprocess_config(built.model)

    def write(folder: Path, model_state: dict) -> None:
        write_open_clip_files(folder, model_state, cfg, preprocess, name, built.tokenizer)

    return write


# -- python -m infclip.export ------------------------------------------------------------------


def find_checkpoint(path: Path, step: Optional[int], warn: Callable[[str], None] = print) -> Path:
    """A checkpoint folder whose files verify: ``path`` itself or the run's ``checkpoints/step_N``
    (refused when damaged), or the run's newest intact one (no step: damaged ones set aside)."""
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if step is None and not (path / "model.pt").is_file():
        found = newest_intact(root, warn) if root.is_dir() else None
    else:
        found = path if step is None else root / f"step_{step:08d}"
        found = found if (found / "model.pt").is_file() else None
        problem = verify_loaded_files(found) if found is not None else None
        if problem:
            raise ExportError(f"checkpoint {found} is damaged: {problem}; export another step (--step N) "
                              "or give the run folder (its newest intact checkpoint is used)")
    if found is None:
        have = sorted(p.name for p in root.glob("step_*")) if root.is_dir() else []
        what = f"found {have}, none intact" if have and step is None else f"found {have or 'none'}"
        raise ExportError(f"{path}: no checkpoint{'' if step is None else f' for --step {step}'} ({what}); "
                          "give a run folder or a checkpoints/step_XXXXXXXX folder")
    return found


def _run_model_config(ckpt: Path, model: Optional[str]) -> dict:
    """The run's ``model`` section (config.yaml two levels up), or {name: --model}."""
    from omegaconf import OmegaConf

    run_cfg = ckpt.parent.parent / "config.yaml"
    try:
        section = dict(OmegaConf.to_container(OmegaConf.load(run_cfg).model)) if run_cfg.is_file() else {}
    except Exception as e:  # YAML errors, a config without a model mapping
        raise ExportError(f"{run_cfg} cannot be read as the run's configuration ({type(e).__name__}); "
                          "name the architecture with --model NAME") from None
    if model is not None:
        section.update(name=model, config_file=None)
    if not section.get("name"):
        raise ExportError(f"{ckpt}: no run config.yaml at {run_cfg}; name the architecture with --model NAME")
    return section


def export(ckpt: Path, out: Path, model: Optional[str] = None) -> Path:
    """Write ``ckpt``'s weights in open_clip's format into ``out``; returns ``out``. ``ckpt``
    comes from ``find_checkpoint`` (its files verified against its manifest)."""
    if model is None and (ckpt / CONFIG_NAME).is_file() and (ckpt / WEIGHTS_NAME).is_file():
        out.mkdir(parents=True, exist_ok=True)
        for name in open_clip_files(ckpt):  # written at save time: copy them (and any HF tokenizer files)
            shutil.copy2(ckpt / name, out / name)
        return out
    import open_clip

    from infclip.config import ModelConfig
    from infclip.model import build_model

    section = _run_model_config(ckpt, model)
    mcfg = ModelConfig(name=section["name"], config_file=section.get("config_file"),
                       init_logit_bias=section.get("init_logit_bias"), image_size=section.get("image_size"))
    built = build_model(mcfg)  # random init: only its config and preprocessing are used
    preprocess = preprocess_config(built.model)
    tag = section.get("pretrained")
    tag_cfg = open_clip.get_pretrained_cfg(built.name, tag) if tag and not os.path.isfile(str(tag)) else {}
    preprocess.update({k: list(v) if isinstance(v, tuple) else v for k, v in tag_cfg.items() if k in _PREPROCESS_KEYS})
    state = torch.load(ckpt / "model.pt", map_location="cpu", weights_only=True)
    missing = set(built.model.state_dict()) ^ set(state)
    if missing:
        raise ExportError(f"{ckpt}/model.pt does not fit model {built.name!r} (keys differ, e.g. "
                          f"{sorted(missing)[:3]}); pass the architecture it was trained with: --model NAME")
    write_open_clip_files(out, state, model_config(built.name, mcfg.init_logit_bias, mcfg.image_size), preprocess,
                          built.name,
                          built.tokenizer)
    return out


def _check_out(out: Path, ckpt: Path) -> None:
    """--out is a folder (new or existing) other than the checkpoint itself."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file: give a folder for the open_clip files (created if missing)")
    if out.exists() and out.resolve() == ckpt.resolve():
        raise ExportError(f"--out {out} is the checkpoint folder itself, which holds these files already; give "
                          "another folder (or load it as it is: open_clip's 'local-dir:' + that folder)")


def check_out(out: Path) -> Path:
    """``out`` as a folder files can be written to (created); ExportError naming the path and
    the fix otherwise (an existing regular file, a read-only file system, a path through a file)."""
    try:
        if out.exists() and not out.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "exists and is not a folder")
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        why = "a part of its path is a file, not a folder" if e.errno == errno.EEXIST else e.strerror
        raise ExportError(f"--out {out} cannot be used as the output folder ({why or e}); give a "
                          "writable folder path (created if missing)") from None
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infclip.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="run folder (newest checkpoint) or a checkpoints/step_XXXXXXXX folder")
    parser.add_argument("--step", type=int, default=None, help="export checkpoints/step_<N> of the run")
    parser.add_argument("--out", required=True, help="output folder (created)")
    parser.add_argument("--model", default=None, help="architecture name when the run has no config.yaml")
    args = parser.parse_args(argv)
    out = Path(args.out).expanduser()
    try:
        out = check_out(Path(args.out).expanduser())  # before any work
        ckpt = find_checkpoint(Path(args.checkpoint).expanduser(), args.step,
                               warn=lambda line: print(line, file=sys.stderr, flush=True))
        _check_out(out, ckpt)
        try:
            out = export(ckpt, out, args.model)
        except OSError as e:  # the folder was usable a moment ago: a full disk, a removed folder
            raise ExportError(f"--out {out}: writing failed ({e.strerror or e}); free space or give another "
                              "folder") from None
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {ckpt} -> {out}\n  open_clip.create_model_and_transforms('local-dir:{out}')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
