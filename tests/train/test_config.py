"""Config composition through Hydra and validation before any model work."""

import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from infclip.config import ConfigError, register_configs, validate

CONFIGS = str(Path(__file__).resolve().parents[2] / "configs")
register_configs()


def _compose(*overrides):
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


@pytest.mark.parametrize("experiment", ["quickstart", "vit_b32_laion", "lit_b16_cc12m"])
def test_presets_compose(experiment):
    cfg = _compose(f"experiment={experiment}")
    assert cfg.experiment == experiment
    if experiment == "lit_b16_cc12m":
        assert cfg.model.lock_image and cfg.model.name == "ViT-B-16"
    if experiment == "vit_b32_laion":
        assert cfg.optim.name == "adafactor" and cfg.optim.beta2 == 0.95


def test_quickstart_is_valid_on_one_and_two_ranks():
    cfg = _compose()
    validate(cfg, 1)
    validate(cfg, 2)


def test_unknown_key_is_rejected_with_its_name():
    with pytest.raises(Exception, match="foo"):
        _compose("batch.foo=1")


def test_wrong_type_is_rejected():
    with pytest.raises(Exception, match="global_size"):
        _compose("batch.global_size=many")


@pytest.mark.parametrize(
    "overrides, world, match",
    [
        (["batch.global_size=100"], 3, r"batch.global_size=100 is not divisible by the world size 3"),
        (["batch.global_size=256", "batch.micro_size=48"], 2, r"batch.micro_size=48 must divide .* 128"),
        (["batch.global_size=0"], 1, r"batch.global_size must be > 0"),
        (["loss.impl=fast"], 1, r"loss.impl='fast' is not valid"),
        (["precision.amp=fp8"], 1, r"precision.amp='fp8'"),
        (["optim.name=sgd"], 1, r"optim.name='sgd'"),
        (["steps=0"], 1, r"steps must be > 0"),
        (["data.kind=wds"], 1, r"data.kind=wds needs data.shards"),
        (["checkpoint.keep_last=0"], 1, r"checkpoint.keep_last must be > 0"),
        (["loss.impl=triton", "device=cpu"], 1, r"loss.impl=triton needs CUDA"),
        (["loss.kind=nt_xent", "loss.temperature=0"], 1, r"loss.temperature must be > 0"),
        (["max_nonfinite=0"], 1, r"max_nonfinite must be > 0"),
        (["dist.join_timeout_s=0"], 1, r"dist.join_timeout_s must be > 0"),
        (["dist.stop_grace_s=-1"], 1, r"dist.stop_grace_s must be >= 0"),
        (["checkpoint.every_n_steps=-1"], 1, r"checkpoint.every_n_steps must be >= 0"),
        (["schedule.min_lr_ratio=2"], 1, r"schedule.min_lr_ratio must be in \[0, 1\]"),
        (["optim.lr=inf"], 1, r"optim.lr=inf is not a finite number"),
        (["optim.lr=nan"], 1, r"optim.lr=nan is not a finite number"),
        (["optim.lr=-1e-3"], 1, r"optim.lr must be > 0"),
        (["optim.beta2=1.0"], 1, r"optim.beta2 must be in \[0, 1\)"),
        (["optim.beta1=-0.1"], 1, r"optim.beta1 must be in \[0, 1\)"),
        (["optim.eps=0"], 1, r"optim.eps must be > 0"),
        (["model.max_logit_scale=inf"], 1, r"model.max_logit_scale=inf is not a finite number"),
        (["+optim.lrr=1"], 1, r"unknown config key 'optim.lrr'.*did you mean optim.lr\?"),
        (["+foo=1"], 1, r"unknown config key 'foo'"),
        (["loss.duplicates=drop"], 1,
         r"loss.duplicates='drop' is not valid; choose one of \['off', 'mask', 'positive'\]"),
        (["loss.duplicate_key=image"], 1, r"loss.duplicate_key='image' is not valid; choose one of \['caption', "),
        (["loss.duplicates=mask", "loss.impl=vanilla"], 1,
         r"loss.duplicates=mask needs loss.kind=clip with loss.impl=auto, torch or triton.*impl=vanilla"),
        (["loss.duplicates=positive", "loss.grad_filter=1e-3"], 1, r"loss.duplicates=positive needs .*grad_filter=0"),
        (["+model.lock_imag=true"], 1, r"did you mean model.lock_image\?"),
        (["data.decode_reserved_sms=-4"], 1, r"data.decode_reserved_sms must be a whole number >= 0"),
        (["data.decode_ahead_from=loss"], 1, r"data.decode_ahead_from must be 'first_pass' or 'replay' .*got 'loss'"),
        (["model.compile=true", "model.compile_mode=fast"], 1,
         r"model.compile_mode='fast' is not valid; choose one of \['default', 'max-autotune-no-cudagraphs', "),
        (["model.compile_mode=max-autotune-no-cudagraphs"], 1,
         r"model.compile_mode=max-autotune-no-cudagraphs with model.compile=false: .*add model.compile=true"),
        (["model.compile=true", "model.compile_mode=reduce-overhead"], 1,
         r"model.compile_mode=reduce-overhead captures CUDA graphs .*overwritten.*set model.compile_mode=default"),
        (["model.compile=true", "model.compile_mode=max-autotune"], 1,
         r"model.compile_mode=max-autotune captures CUDA graphs .*set model.compile_mode=default \(or "
         r"max-autotune-no-cudagraphs\)"),
        (["data.decode=cpu", "data.decode_reserved_sms=4"], 1,
         r"data.decode_reserved_sms=4 means nothing with data.decode=cpu .*set data.decode_reserved_sms=0"),
    ],
)
def test_validation_names_key_and_fix(overrides, world, match, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # CPU Triton only under the interpreter
    cfg = _compose(*overrides)
    with pytest.raises(ConfigError, match=match):
        validate(cfg, world)


def test_bad_config_fails_before_model_work(tmp_path):
    """train.py exits with the validation message and creates no run directory."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(root / "train.py"), "batch.global_size=256", "batch.micro_size=100",
         f"run_dir={run_dir}"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    assert "batch.micro_size=100 must divide" in proc.stderr
    assert not run_dir.exists()


def test_config_error_is_one_paragraph_without_traceback_unless_debug(tmp_path):
    """``+optim.lrr=1`` (the fix Hydra's own message suggests for a typo) is refused before
    any work, in one paragraph naming the nearest key; INFCLIP_DEBUG=1 adds the traceback."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(root / "train.py"), "+optim.lrr=1", f"run_dir={run_dir}"]
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "INFCLIP_DEBUG")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "did you mean optim.lr?" in proc.stderr and "Traceback" not in proc.stderr + proc.stdout
    assert len(proc.stderr.strip().splitlines()) == 2, proc.stderr  # the paragraph + the debug hint
    assert not run_dir.exists()
    debug = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**env, "INFCLIP_DEBUG": "1"})
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "optim.lrr" in debug.stderr


def test_eval_task_errors_name_the_task_key():
    cfg = _compose("eval.tasks.0.kind=bogus")
    with pytest.raises(ValueError, match=r"eval.tasks\[0\].kind='bogus'"):
        validate(cfg, 1)


def test_data_errors_name_the_key():
    cfg = _compose("data.loader_batch=0")
    with pytest.raises(ValueError, match=r"data.loader_batch"):
        validate(cfg, 1)


def test_a_data_error_raised_in_a_loader_worker_prints_only_its_message():
    import runpy

    from infclip.data.shards import DataError

    root = Path(__file__).resolve().parents[2]
    paragraph = runpy.run_path(str(root / "train.py"), run_name="train_module")["paragraph"]
    wrapped = DataError("Caught DataError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
                        '  File "stream.py", line 1, in raw_stream\n'
                        "infclip.data.shards.DataError: no training shard gives a sample: 4 shards in a row")
    assert paragraph(wrapped) == "error (DataError): no training shard gives a sample: 4 shards in a row"


@pytest.mark.parametrize("args, match", [
    (["batch.global_szie=256"], r"unknown config key 'batch.global_szie'.*did you mean batch.global_size\?"),
    (["memory.offlaod=true"], r"did you mean memory.offload\?"),
    (["stpes=10"], r"did you mean steps\?"),
    (["data.kind=wds", "data.shards=/data/{00000..00009}.tar"], r"must be quoted .*\"data.shards='/data/"),
])
def test_command_line_typos_get_our_paragraph_and_exit_2_before_hydra(args, match, tmp_path):
    """Hydra's own message for a typo recommends '+key=' (the wrong fix) and exits 1."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(root / "train.py"), *args, f"run_dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert re.search(match, proc.stderr), proc.stderr
    assert "Traceback" not in proc.stderr and "+" + args[0] not in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("args", [["experiment=quickstart", "steps=3"], ["+x=1"], ["hydra.run.dir=/tmp/x"],
                                  ["eval.tasks=[]"], ["data.sources=[]"], ["~logging"],
                                  ["eval.tasks=[{name: h, kind: retrieval, format: flat, root: '/x/h'}]"]])
def test_valid_or_hydra_own_overrides_pass_the_command_line_check(args):
    from infclip.config import check_overrides

    check_overrides(args, ("experiment", "hydra", "loss", "eval_task"))


def test_an_unknown_model_name_suggests_the_nearest_open_clip_names(tmp_path):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(root / "train.py"), "model.name=ViT-B-33", f"run_dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2 and "did you mean ViT-B-32" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()


def test_an_image_size_the_model_cannot_take_is_refused_before_the_model(tmp_path):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(root / "train.py"), "data.image_size=32", f"run_dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "data.image_size=32 but model.name=infclip-tiny takes 48-px images" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()


@pytest.mark.parametrize("missing, overrides, match", [
    ("wandb", ["logging.wandb_mode=offline"],
     r"logging.wandb_mode=offline logs the run to Weights & Biases, but this Python has no wandb package.*"
     r"pip install 'wandb>=0.17'\), or set logging.wandb_mode=disabled"),
    ("tensorboard", ["logging.wandb_mode=disabled", "logging.tensorboard=true"],
     r"logging.tensorboard=true writes TensorBoard event files, but this Python has no tensorboard package.*"
     r"pip install 'infclip\[tensorboard\]'\), or set logging.tensorboard=false"),
])
def test_a_missing_logging_backend_is_refused_before_any_model(missing, overrides, match, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else real(name, *a))
    with pytest.raises(ConfigError, match=match):
        validate(_compose(*overrides), 1)
    validate(_compose("logging.wandb_mode=disabled", "logging.tensorboard=false"), 1)  # neither asked: no refusal
