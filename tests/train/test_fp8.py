"""precision.fp8 (infclip.fp8): which layers become torchao Float8Linear, the refusal before any
model is built, nothing changed when off, FP8 numerics on the CPU, and the gradient cache."""

from __future__ import annotations

import copy
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_testutils import (
    assert_grads_close, assert_replay_exact_and_cached_step_full, batch, config, engine_for, grads_of,
    normalize, reference_grads, tiny_clip,
)

from infclip.attention import sdpa_attention
from infclip.config import ConfigError, ModelConfig, TrainConfig, validate
from infclip.fp8 import convert_towers, fp8_layer, fp8_modules, fp8_problem
from infclip.model import build_model
from infclip.train.lit import apply_locks

needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                   reason="torchao not installed (pip install torchao)")
ROOT = Path(__file__).resolve().parents[2]
BLOCK_LAYERS = {"attn.in_proj", "attn.out_proj", "mlp.c_fc", "mlp.c_proj"}


def _tiny(**kw):
    return build_model(ModelConfig(name="infclip-tiny", **{"sdpa_attention": True, **kw})).model


def _pattern(names):
    return {re.sub(r"\.\d+\.", ".N.", n) for n in names}


@needs_torchao
def test_the_block_linears_and_in_projections_are_converted_and_nothing_else():
    model = _tiny()
    blocks_v, blocks_t = len(model.visual.transformer.resblocks), len(model.transformer.resblocks)
    done = convert_towers(model, "tensorwise")
    names = fp8_modules(model)
    assert len(names) == 4 * (blocks_v + blocks_t)
    assert _pattern(names) == {f"{t}resblocks.N.{layer}" for t in ("visual.transformer.", "transformer.")
                               for layer in BLOCK_LAYERS}
    assert sorted(done.layers + [f"{n}.in_proj" for n in done.in_projs]) == sorted(names)
    line = done.line()
    assert f"in {len(names)} linear layers" in line and "visual.transformer.resblocks.N.mlp.c_fc" in line
    # embeddings, norms, projections untouched
    assert type(model.visual.conv1).__name__ != "Float8Linear" and isinstance(model.visual.proj, torch.nn.Parameter)
    assert type(model.visual.transformer.resblocks[0].ln_1).__name__ == "LayerNorm"


def test_the_filter_on_a_built_tower():
    model = _tiny()
    block = model.visual.transformer.resblocks[0]
    assert fp8_layer(block.mlp.c_fc, "visual.transformer.resblocks.0.mlp.c_fc")
    assert fp8_layer(block.attn.out_proj, "visual.transformer.resblocks.0.attn.out_proj")
    head = torch.nn.Linear(64, 64)
    assert not fp8_layer(head, "visual.head.proj")  # outside the blocks: a final projection
    assert not fp8_layer(torch.nn.Linear(24, 64), "visual.transformer.resblocks.0.mlp.c_fc")  # not a multiple of 16
    frozen = torch.nn.Linear(64, 64).requires_grad_(False)
    assert not fp8_layer(frozen, "visual.transformer.resblocks.0.mlp.c_fc")


def test_the_size_rule_at_vit_widths():
    """torchao's size rules at ViT-B (768, MLP 3072), ViT-L (1024, 4096) and ViT-H (1280, 5120):
    tensorwise keeps the up-projections and q/k/v, rowwise only ViT-H's up-projection."""
    from infclip.fp8 import large_enough

    for width in (768, 1024):
        assert large_enough("tensorwise", width, 4 * width)  # mlp.c_fc
        assert large_enough("tensorwise", width, 3 * width)  # attn.in_proj
        assert not large_enough("tensorwise", 4 * width, width)  # mlp.c_proj
        assert not large_enough("tensorwise", width, width)  # attn.out_proj
        assert not any(large_enough("rowwise", i, o) for i, o in ((width, 4 * width), (4 * width, width)))
    assert large_enough("tensorwise", 5120, 1280) and large_enough("rowwise", 1280, 5120)
    assert not large_enough("rowwise", 5120, 1280)
    with pytest.raises(ValueError, match="no FP8 size rule"):
        large_enough("off", 4096, 4096)


@needs_torchao
def test_large_layers_only_on_a_vit_b16():
    model = build_model(ModelConfig(name="ViT-B-16", sdpa_attention=True)).model
    done = convert_towers(model, "tensorwise", "large")
    names = fp8_modules(model)
    assert _pattern(names) == {f"{t}resblocks.N.{layer}" for t in ("visual.transformer.", "transformer.")
                               for layer in ("mlp.c_fc", "attn.in_proj")}
    assert len(names) == 2 * (12 + 12)
    assert "fp8_layers=large" in done.line() and f"in {len(names)} linear layers" in done.line()
    assert type(model.visual.transformer.resblocks[0].mlp.c_proj).__name__ == "Linear"


@needs_torchao
def test_large_layers_under_rowwise_leave_a_vit_b16_as_it_was_and_say_so():
    model = build_model(ModelConfig(name="ViT-B-16", sdpa_attention=True)).model
    kinds = [type(m) for m in model.modules()]
    done = convert_towers(model, "rowwise", "large")
    assert fp8_modules(model) == [] and [type(m) for m in model.modules()] == kinds
    assert "in 0 linear layers" in done.line() and "no layer of this model passes" in done.line()
    with pytest.raises(ValueError, match="fp8_layers must be one of"):
        convert_towers(model, "tensorwise", "big")


def test_fp8_layers_takes_all_or_large():
    cfg = TrainConfig()
    assert cfg.precision.fp8_layers == "all"
    cfg.precision.fp8_layers = "most"
    with pytest.raises(ConfigError, match="fp8_layers"):
        validate(cfg, 1)


@needs_torchao
def test_nn_multihead_attention_keeps_its_out_projection_in_bf16():
    """With model.sdpa_attention=false the attention's own forward reads out_proj.weight: only
    the MLP layers are converted (a swapped out_proj would never run)."""
    model = _tiny(sdpa_attention=False)
    convert_towers(model, "rowwise")
    assert _pattern(fp8_modules(model)) == {f"{t}resblocks.N.mlp.{n}" for t in ("visual.transformer.", "transformer.")
                                            for n in ("c_fc", "c_proj")}


def test_fp8_off_changes_nothing():
    """precision.fp8=off: the same modules, Parameters and state-dict keys (no torchao needed)."""
    model = _tiny()
    keys, params, kinds = list(model.state_dict()), list(model.named_parameters()), [type(m) for m in model.modules()]
    assert convert_towers(model, "off").layers == []
    assert list(model.state_dict()) == keys and [type(m) for m in model.modules()] == kinds
    assert [(n, id(p)) for n, p in model.named_parameters()] == [(n, id(p)) for n, p in params]
    assert fp8_modules(model) == [] and "fp8=off" in convert_towers(model, "off").line()


@needs_torchao
def test_fp8_keeps_parameters_and_state_dict_keys():
    """Float8Linear takes over the layers' own Parameters: names, objects and keys unchanged, so
    an optimizer built afterwards and every checkpoint see the same tensors."""
    model = _tiny()
    keys, params = list(model.state_dict()), list(model.named_parameters())
    convert_towers(model, "tensorwise")
    assert fp8_modules(model)
    assert list(model.state_dict()) == keys
    assert [(n, id(p)) for n, p in model.named_parameters()] == [(n, id(p)) for n, p in params]


@needs_torchao
def test_lit_locked_image_tower_is_not_converted():
    model = _tiny()
    apply_locks(model, ModelConfig(name="infclip-tiny", lock_image=True))
    convert_towers(model, "tensorwise")
    names = fp8_modules(model)
    assert names and not any(n.startswith("visual.") for n in names)


@pytest.mark.parametrize("device, cap, err, fragment", [
    ("cpu", None, None, "this run trains on cpu"),
    ("cuda", (8, 0), None, "compute capability 8.0"),
    ("cuda", (9, 0), "ModuleNotFoundError: No module named 'torchao'", "pip install torchao"),
])
def test_refusal_names_the_problem_and_the_fix(device, cap, err, fragment):
    text = fp8_problem("rowwise", device, cap, err)
    assert fragment in text and "precision.fp8=off" in text
    assert fp8_problem("off", device, cap, err) is None
    assert fp8_problem("tensorwise", "cuda", (9, 0), None) is None
    assert fp8_problem("tensorwise", "cuda", (8, 9), None) is None


def test_validate_refuses_fp8_on_cpu_and_outside_bf16(monkeypatch):
    import infclip.fp8 as fp8_mod

    cfg = TrainConfig()
    cfg.device, cfg.precision.fp8, cfg.precision.amp = "cpu", "tensorwise", "bf16"
    with pytest.raises(ConfigError, match="this run trains on cpu"):
        validate(cfg, 1)
    monkeypatch.setattr(fp8_mod, "check_fp8", lambda recipe, device: None)  # a capable GPU
    validate(cfg, 1)
    for amp in ("fp16", "fp32"):
        cfg.precision.amp = amp
        with pytest.raises(ConfigError, match=f"precision.amp={amp}: .* set precision.amp=bf16"):
            validate(cfg, 1)
    cfg.precision.fp8 = "off"
    validate(cfg, 1)


def test_validate_on_a_faked_gpu_below_sm89(monkeypatch):
    import infclip.config as config_mod
    import infclip.fp8 as fp8_mod

    monkeypatch.setattr(config_mod, "_cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    cfg = TrainConfig()
    cfg.device, cfg.precision.fp8, cfg.precision.amp = "cuda", "rowwise", "bf16"
    with pytest.raises(ConfigError, match="compute capability 8.0"):
        validate(cfg, 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fp8_mod, "torchao_import_error", lambda: None)
    validate(cfg, 1)


def test_train_py_refuses_fp8_on_cpu_with_one_paragraph_and_status_2(tmp_path):
    cmd = [sys.executable, str(ROOT / "train.py"), "device=cpu", "precision.fp8=tensorwise", "model.name=infclip-micro",
           f"data.synthetic_root={tmp_path / 'synthetic'}", f"run_dir={tmp_path / 'run'}",
           "logging.wandb_mode=disabled"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr.strip()
    assert "precision.fp8=tensorwise" in err and "precision.fp8=off" in err and "Traceback" not in err
    assert not (tmp_path / "synthetic").exists() and not (tmp_path / "run").exists()  # nothing built or written


@needs_torchao
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_embeddings_and_gradients_within_fp8_error_of_float64(recipe):
    """torchao's Float8Linear runs on the CPU: the converted tiny CLIP's embeddings stay within
    FP8 rounding of the float64 model's (relative error < 15 %, more than bf16's: FP8 ran), and
    every gradient within 30 %."""
    torch.manual_seed(0)
    model = tiny_clip(dropout=0.0, patch_dropout=0.0).train()
    sdpa_attention(model)
    ref, bf = copy.deepcopy(model).double(), copy.deepcopy(model)
    convert_towers(model, recipe)
    images, tokens = batch(16)
    x = normalize(images)
    want = ref(image=x.double(), text=tokens)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = bf(image=x, text=tokens)
    got = model(image=x, text=tokens)
    for i in (0, 1):
        rel = ((got[i].double() - want[i]).norm() / want[i].norm()).item()
        rel_bf16 = ((low[i].double() - want[i]).norm() / want[i].norm()).item()
        assert rel_bf16 < rel < 0.15, (i, rel, rel_bf16)
    (want[0] * want[1]).sum().backward()
    (got[0].double() * got[1].double()).sum().backward()
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        g = ref_grads[name].grad
        if g is None:  # the logit scale: not in this product
            continue
        assert ((p.grad.double() - g).norm() / g.norm()).item() < 0.3, name


@needs_torchao
def test_gradient_cache_with_fp8_replays_exactly_and_equals_the_full_batch_step():
    """Dynamic FP8 scaling keeps no state: the replay's embeddings equal the cache pass's bit
    for bit, and the cached step's gradients the full-batch step's."""
    model = tiny_clip(dropout=0.1, patch_dropout=0.25).train()
    sdpa_attention(model)
    convert_towers(model, "tensorwise")
    assert_replay_exact_and_cached_step_full(model, seed=3, rtol=1e-4)


def _fp8_clip():
    model = tiny_clip(dropout=0.0, patch_dropout=0.0)  # same seed, same weights on every rank
    sdpa_attention(model)
    convert_towers(model, "tensorwise")
    return model


def _ddp_worker(images, tokens) -> dict:
    """One gloo rank: its 6 rows through DDP + the engine (micro-batches of 2)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _fp8_clip()
    engine = engine_for(config(6, 2, world=2), DDP(model, broadcast_buffers=False), group=dist.group.WORLD, world=2)
    out = engine.step(images, tokens)
    return {"grads": grads_of(model), "loss": out.global_loss}


@needs_torchao
def test_fp8_under_ddp_equals_one_process_on_the_global_batch(tmp_path):
    """2 gloo ranks x 6 rows == one process on the 12 rows, micro-batches of 2 in both: each
    micro-batch is cast with its own dynamic FP8 scales wherever it runs."""
    from engine_testutils import spawn_ranks

    got = spawn_ranks(_ddp_worker, tmp_path, 2, 6)
    model = _fp8_clip()
    images, tokens = batch(12)
    loss, want = reference_grads(model, images, tokens, 2)
    torch.testing.assert_close(got["loss"], loss, atol=1e-5, rtol=1e-5)
    assert_grads_close(got["grads"], want, atol=1e-5, rtol=1e-4)


@needs_torchao
def test_compiled_fp8_towers_match_eager():
    """model.compile on FP8 towers (the hidden FP8 in-projection included): no graph break,
    embeddings and gradients as in eager mode."""
    from infclip.model import compile_towers

    torch._dynamo.reset()
    model = _fp8_clip().train()
    eager = copy.deepcopy(model)
    compile_towers(model)
    images, tokens = batch(8)
    outs = []
    for m in (model, eager):
        img, txt, _ = m(image=normalize(images), text=tokens)
        (img * txt).sum().backward()
        outs.append((img, txt))
    assert not torch._dynamo.utils.counters["graph_break"]
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)
    assert_grads_close(grads_of(model), grads_of(eager), atol=1e-4, rtol=1e-2)
    torch._dynamo.reset()


@needs_torchao
def test_lit_split_with_fp8_trains_the_unlocked_block_in_fp8_and_matches_the_reference():
    """LiT with the last ViT block unlocked (a split plan: the locked trunk runs once, in bf16/fp32):
    only the unlocked block and the text tower are FP8, and the cached step equals the full-batch step."""
    model = tiny_clip(dropout=0.0, patch_dropout=0.0)
    sdpa_attention(model)
    cfg = config(8, 2, lock_image=True, lock_image_unlocked_groups=2)
    plan = apply_locks(model, cfg.model)
    assert plan.image.mode == "split"
    convert_towers(model, "rowwise")
    visual = {n for n in fp8_modules(model) if n.startswith("visual.")}
    assert visual == {f"visual.transformer.resblocks.1.{n}" for n in BLOCK_LAYERS}
    model.train()
    ref = copy.deepcopy(model)
    images, tokens = batch(8)
    torch.manual_seed(11)
    _, want = reference_grads(ref, images, tokens, 2)
    torch.manual_seed(11)
    engine_for(cfg, model).step(images, tokens)
    assert_grads_close(grads_of(model), want, atol=1e-5, rtol=1e-4)


@needs_torchao
def test_train_py_with_fp8_says_which_layers_trains_and_writes_plain_checkpoints(tmp_path):
    """The real train.py with the capability check faked (FP8 GEMMs run on the CPU here): the
    startup line names the 8 FP8 layers of infclip-micro (one block per tower), the loss is
    finite, and the checkpoint loads into a model built without FP8."""
    import json

    from test_train_cli import TINY, _env

    run = tmp_path / "run"
    args = [str(ROOT / "train.py"), f"data.synthetic_root={tmp_path / 'synthetic'}", *TINY, f"run_dir={run}",
            "steps=2", "eval.tasks=[]", "precision.fp8=tensorwise", "precision.amp=bf16", "device=cpu",
            "model.sdpa_attention=true"]
    code = (f"import runpy, sys; sys.path.insert(0, {str(ROOT)!r}); import infclip.fp8 as f; "
            "f.check_fp8 = lambda recipe, device: None; "
            f"sys.argv = {args!r}; runpy.run_path(sys.argv[0], run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env=_env(tmp_path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("precision: fp8=tensorwise"))
    assert "in 8 linear layers" in line and "visual.transformer.resblocks.N.attn.in_proj" in line
    losses = [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    state = torch.load(next((run / "checkpoints").glob("step_*")) / "model.pt", weights_only=True)
    state = state.get("model", state)
    plain = build_model(ModelConfig(name="infclip-micro")).model
    plain.load_state_dict(state, strict=True)


@needs_torchao
def test_prepare_model_locks_then_swaps_to_fp8_then_compiles(monkeypatch, capsys):
    """``prepare_model``'s order, which the trainer and bench_towers share: the locks first (the
    hook before the swap sees a frozen image tower and no FP8 layer), then FP8 in the trained
    layers only (the hook before compile sees them), then the compile; the FP8 line returned and
    printed. With FP8 off nothing is swapped and the line is ''."""
    from omegaconf import OmegaConf

    from infclip.train import build
    from infclip.train.distributed import DistInfo

    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    order = []
    monkeypatch.setattr(build, "_compile", lambda cfg, info, model: order.append("compile"))
    for fp8 in ("tensorwise", "off"):
        cfg = OmegaConf.structured(TrainConfig())
        cfg.model.name, cfg.model.sdpa_attention, cfg.model.lock_image = "infclip-tiny", True, True
        cfg.model.compile, cfg.precision.fp8 = True, fp8
        model = build_model(cfg.model).model
        order.clear()

        def before_fp8(m=model):
            frozen = all(not p.requires_grad for p in m.visual.parameters())
            order.append(("locks", frozen, len(fp8_modules(m))))

        line = build.prepare_model(cfg, info, model, before_fp8=before_fp8,
                                   before_compile=lambda m=model: order.append(("fp8", len(fp8_modules(m)))))
        swapped = len(fp8_modules(model))
        assert order == [("locks", True, 0), ("fp8", swapped), "compile"], order
        assert not any(n.startswith("visual.") for n in fp8_modules(model))
        if fp8 == "off":
            assert swapped == 0 and line == ""
        else:
            assert swapped > 0 and line and line in capsys.readouterr().out
