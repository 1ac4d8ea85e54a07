"""Non-finite steps: skipped (no update), counted, logged; K consecutive ones abort with a
clear message and a checkpoint of the last good weights. NaNs are injected into the
gradients of chosen steps through INFCLIP_INJECT_NAN_AT_STEPS."""

import torch
from launch_testutils import child_env, records, run, train_cmd

from infclip.train import checkpoint as ckpt


def test_nan_steps_are_skipped_then_k_consecutive_abort_with_checkpoint(tmp_path):
    cmd = train_cmd(tmp_path / "synthetic", tmp_path / "run", "steps=10", "max_nonfinite=3",
                    "checkpoint.every_n_steps=3", "checkpoint.keep_last=5")
    proc = run(cmd, cwd=tmp_path, env=child_env(INFCLIP_INJECT_NAN_AT_STEPS="2,4,5,6"))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "3 consecutive non-finite steps (max_nonfinite=3)" in out, out[-3000:]
    assert "weights after step 3" in out and "step_00000006" in out

    steps = {r["step"]: r for r in records(tmp_path / "run") if "loss" in r}
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]  # skipped steps are always logged
    assert [steps[s]["skipped_step"] for s in range(1, 7)] == [0, 1, 0, 1, 1, 1]
    assert [steps[s]["nonfinite_steps"] for s in range(1, 7)] == [0, 1, 1, 2, 3, 4]
    # a skipped step leaves the weights alone (the logit scale is one of them) ...
    assert steps[2]["logit_scale"] == steps[1]["logit_scale"]
    assert steps[3]["logit_scale"] != steps[2]["logit_scale"]  # ... and training recovers

    names = [p.name for p in ckpt.list_checkpoints(tmp_path / "run")]
    assert names == ["step_00000003", "step_00000006"]
    good, _, _ = ckpt.load(tmp_path / "run" / "checkpoints" / "step_00000003", rank=0)
    last, train_state, _ = ckpt.load(tmp_path / "run" / "checkpoints" / "step_00000006", rank=0)
    assert train_state["step"] == 6 and train_state["nonfinite_total"] == 4
    for k in good:  # steps 4-6 were skipped: the abort checkpoint holds step 3's weights
        assert torch.equal(good[k], last[k]), k
    assert all(torch.isfinite(v).all() for v in last.values() if v.is_floating_point())
