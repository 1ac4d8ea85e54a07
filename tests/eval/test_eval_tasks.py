"""The eval command's task list (presets, inline dicts, eval.tasks, suites) and its guards:
class names against labels, the checkpoint's architecture, eval.workers from the machine."""

import json
import os
import subprocess
import sys
import tarfile
import io

import pytest
import torch
from evalutils import OracleModel, number_tokenizer, png, to_tensor, write_wds

from infclip.eval import EvalConfig, EvalConfigError, EvalTaskConfig, run_evals
from infclip.eval.config import MAX_AUTO_WORKERS, resolve_workers
from infclip.eval.data import DataError
from infclip.eval.suites import SUITES

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _compose(overrides):
    from hydra import compose, initialize_config_dir

    from infclip.eval import cli

    cli.register()
    with initialize_config_dir(config_dir=str(cli.CONFIG_DIR), version_base=None):
        return compose(config_name="eval", overrides=overrides)


def _plan(overrides):
    from infclip.eval.cli import plan_tasks

    return plan_tasks(_compose(["checkpoint=none", *overrides]))


# -- one task syntax ---------------------------------------------------------------------------


def test_presets_and_inline_tasks_mix_and_keep_their_own_names():
    tasks, _ = _plan(["data_root=/x", "tasks=[imagenet,{name: digits, kind: zeroshot, root: /d, format: imagefolder}]",
                      "+task.digits.max_samples=5"])
    assert [t.name for t in tasks] == ["imagenet", "digits"]
    assert tasks[0].root == "/x/imagenet/val"
    assert (tasks[1].kind, tasks[1].root, tasks[1].format, tasks[1].max_samples) == ("zeroshot", "/d", "imagefolder", 5)


def test_the_trainers_eval_tasks_key_is_used_not_ignored():
    tasks, _ = _plan(["eval.tasks=[{name: digits, kind: zeroshot, root: /d, format: imagefolder}]"])
    assert [(t.name, t.root) for t in tasks] == [("digits", "/d")]
    with pytest.raises(EvalConfigError, match="both given"):
        _plan(["tasks=[imagenet]", "eval.tasks=[{name: digits, root: /d}]"])


def test_inline_tasks_refuse_unknown_keys_and_need_a_name():
    with pytest.raises(EvalConfigError, match=r"tasks\[0\]: unknown key 'rot'"):
        _plan(["tasks=[{name: d, kind: zeroshot, rot: /d}]"])
    with pytest.raises(EvalConfigError, match=r"tasks\[1\]: an inline task needs a name"):
        _plan(["tasks=[imagenet,{kind: zeroshot, root: /d}]"])
    with pytest.raises(EvalConfigError, match=r"tasks\[0\]=.*give a preset or suite name"):
        _plan(["tasks=[[imagenet]]"])


# -- class names against labels ----------------------------------------------------------------


def _folders(root, names, per_class=2):
    for ident, name in enumerate(names):
        (root / name).mkdir(parents=True)
        for j in range(per_class):
            (root / name / f"{j}.png").write_bytes(png(ident, j))


def _evaluate(*tasks):
    cfg = EvalConfig(tasks=list(tasks), batch_size=8, workers=0)
    return run_evals(OracleModel(), number_tokenizer, to_tensor, cfg, step=0, final=True, device="cpu")


def _folder_task(root, **kw):
    return EvalTaskConfig(name="f", kind="zeroshot", format="imagefolder", root=str(root), **kw)


def test_imagenet_names_on_a_small_folder_tree_are_refused(tmp_path):
    """The case that was reported: the imagenet preset on a 10-folder tree scored 1000 names (0.00 %)."""
    _folders(tmp_path, [f"item {i}" for i in range(10)])
    with pytest.raises(DataError, match=r"1000 class names.*10 class folders.*classnames=null"):
        _evaluate(_folder_task(tmp_path, classnames="imagenet"))


def test_a_class_list_for_folders_must_be_the_folder_names(tmp_path):
    names = [f"item {i}" for i in range(10)]  # sorted folder order: item 0, item 1, item 10?, ... (here 0..9)
    _folders(tmp_path / "tree", names)
    shuffled = tmp_path / "shuffled.txt"
    shuffled.write_text("\n".join(reversed(names)) + "\n")  # the folder names, another order: mapped by name
    assert _evaluate(_folder_task(tmp_path / "tree", classnames=str(shuffled)))["eval/f/top1"] == 1.0
    pretty = tmp_path / "pretty.txt"
    pretty.write_text("\n".join(f"class number {i}" for i in range(10)) + "\n")
    with pytest.raises(DataError, match=r"10 names .* are not the 10 folder names.*JSON file mapping"):
        _evaluate(_folder_task(tmp_path / "tree", classnames=str(pretty)))
    short = tmp_path / "short.txt"
    short.write_text("\n".join(names[:8]) + "\n")
    with pytest.raises(DataError, match=r"8 class names .* but 10 class folders"):
        _evaluate(_folder_task(tmp_path / "tree", classnames=str(short)))


def test_a_json_mapping_names_every_folder(tmp_path):
    _folders(tmp_path / "tree", ["b", "a", "c"])  # labels: a=0, b=1, c=2 (sorted folders); images: b=0, a=1, c=2
    mapping = tmp_path / "names.json"
    mapping.write_text(json.dumps({"a": "item 1", "b": "item 0", "c": "item 2"}))
    m = _evaluate(_folder_task(tmp_path / "tree", classnames=str(mapping)))
    assert m["eval/f/top1"] == 1.0
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"a": "item 1", "b": "item 0"}))
    with pytest.raises(DataError, match=r"2 entries .* but 3 class folders.*without a name: \['c'\]"):
        _evaluate(_folder_task(tmp_path / "tree", classnames=str(partial)))


def test_wds_class_names_must_match_the_datasets_own_count(tmp_path):
    write_wds(str(tmp_path), list(range(10)), [f"item {i}" for i in range(10)])
    task = EvalTaskConfig(name="w", kind="zeroshot", format="wds", root=str(tmp_path), classnames="imagenet")
    with pytest.raises(DataError, match=r"1000 class names \('imagenet'\) but the dataset's own .* lists 10"):
        _evaluate(task)


# -- eval.workers ------------------------------------------------------------------------------


def test_eval_workers_default_to_the_cores_this_process_has(monkeypatch):
    assert _compose(["checkpoint=none"]).eval.workers is None and EvalConfig().workers is None
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert resolve_workers(None) == 2 and resolve_workers(3) == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert resolve_workers(None) == MAX_AUTO_WORKERS  # 16 cores per rank, capped


# -- architecture ------------------------------------------------------------------------------


def test_an_architecture_mismatch_names_both_models(tmp_path, micro):
    from infclip.export import write_open_clip_files
    from infclip.model import BuiltModel  # noqa: F401  (registers infclip-micro)
    import open_clip

    from infclip.eval.cli import build

    step = tmp_path / "run" / "checkpoints" / "step_00000001"
    step.mkdir(parents=True)
    model = micro[0]
    torch.save(model.state_dict(), step / "model.pt")
    cfg = _compose(["checkpoint=none"])
    cfg.model = "infclip-tiny"  # (a `model=` override would compose as a config group once train's are registered)
    with pytest.raises(EvalConfigError, match="does not load into model='infclip-tiny'"):  # nothing recorded
        build(cfg, torch.device("cpu"), str(step / "model.pt"))
    write_open_clip_files(step, model.state_dict(), open_clip.get_model_config("infclip-micro"), {},
                          "infclip-micro")
    with pytest.raises(EvalConfigError, match=r"model='infclip-tiny' but checkpoint .* is a 'infclip-micro' model; "
                                              r"drop model= .* or set model=infclip-micro"):
        build(cfg, torch.device("cpu"), str(step / "model.pt"))
    damaged = tmp_path / "damaged.pt"
    damaged.write_bytes((step / "model.pt").read_bytes()[:1000])
    with pytest.raises(EvalConfigError, match=r"damaged.pt does not load into model='infclip-tiny' .*corrupted.*damaged"):
        build(_compose(["checkpoint=none"]), torch.device("cpu"), str(damaged))
    with pytest.raises(EvalConfigError, match="open_clip pretrained tag: name its architecture with model="):
        build(_compose(["checkpoint=none"]), torch.device("cpu"), "laion2b_s34b_b79k")
    loaded, _, _ = build(_compose(["checkpoint=none"]), torch.device("cpu"), str(step / "model.pt"))
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))


# -- suites ------------------------------------------------------------------------------------


def _retrieval_wds(root, n):
    """clip_benchmark's retrieval wds: dataset_type.txt = retrieval, {key}.png + {key}.txt captions."""
    (root / "test").mkdir(parents=True)
    (root / "dataset_type.txt").write_text("retrieval\n")
    with tarfile.open(root / "test" / "0.tar", "w") as tar:
        for k in range(n):
            for name, payload in ((f"s{k:07d}.png", png(k, k)), (f"s{k:07d}.txt", f"item {k} a\nitem {k} b".encode())):
                info = tarfile.TarInfo(name)
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    (root / "test" / "nshards.txt").write_text("1\n")


def test_a_suite_runs_the_datasets_found_and_skips_the_rest(tmp_path, capsys):
    """tasks=[datacomp]: three of its datasets present under data_root (clip_benchmark's wds
    layout), the others skipped with one line each; the suite average is the mean main metric."""
    from infclip.eval.cli import plan_tasks
    from infclip.eval.suites import format_suite, summarize

    write_wds(str(tmp_path / "wds_cifar10"), [i % 10 for i in range(12)], [f"item {i}" for i in range(10)])
    labels = [0, 1, 2, 3, 0, 1]
    write_wds(str(tmp_path / "wds_vtab-pets"), labels, [f"item {i}" for i in range(4)], image_ids=[0, 1, 2, 3, 1, 1])
    _retrieval_wds(tmp_path / "wds_flickr30k", 5)
    tasks, suites = plan_tasks(_compose(["checkpoint=none", "tasks=[datacomp]", f"data_root={tmp_path}"]))
    out = capsys.readouterr().out
    assert [t.name for t in tasks] == ["cifar10", "vtab-pets", "flickr30k"]
    assert out.count("suite datacomp: skipping") == len(SUITES["datacomp"]) - 3
    metrics = run_evals(OracleModel(), number_tokenizer, to_tensor, EvalConfig(tasks=tasks, batch_size=4, workers=0),
                        step=0, final=True, device="cpu")
    summary = summarize(suites[0], metrics)
    pets = summary["eval/datacomp/vtab-pets"]  # DataComp scores Pets by mean per-class recall
    assert pets == metrics["eval/vtab-pets/mean_per_class_recall"] == pytest.approx((1 + 0.5 + 1 + 1) / 4)
    assert summary["eval/datacomp/flickr30k"] == 1.0 and summary["eval/datacomp/cifar10"] == 1.0
    assert summary["eval/datacomp/average"] == pytest.approx((1 + pets + 1) / 3)
    table = format_suite(suites[0], summary)
    assert "3 of 32 datasets found" in table and "average" in table and "vtab-pets" in table


def test_the_suite_command_prints_the_table_and_writes_run_metrics(tmp_path, micro):
    run = tmp_path / "run"
    step = run / "checkpoints" / "step_00000007"
    step.mkdir(parents=True)
    torch.save(micro[0].state_dict(), step / "model.pt")
    (run / "config.yaml").write_text("model:\n  name: infclip-micro\nlogging:\n  wandb_mode: offline\n")
    write_wds(str(tmp_path / "data" / "wds_imagenet-a"), [0, 1, 2, 1], ["a", "b", "c"])
    cmd = [sys.executable, "-m", "infclip.eval", f"checkpoint={run}", "tasks=[imagenet_robustness]",
           f"data_root={tmp_path / 'data'}", "eval.workers=0"]
    env = {k: v for k, v in os.environ.items() if k != "WANDB_MODE"}  # CI sets it; the run's mode is tested
    env.update(WANDB_SILENT="true", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("skipping") == 4 and "1 of 5 datasets found" in proc.stdout
    assert "imagenet-a" in proc.stdout and "average" in proc.stdout
    record = json.loads((run / "eval.jsonl").read_text().splitlines()[-1])
    assert record["step"] == 7 and record["event"] == "eval_command"
    assert record["eval/imagenet_robustness/average"] == record["eval/imagenet-a/top1"]
    assert list((run / "wandb").glob("offline-run-*")), "the run's wandb mode (offline) was not used"
