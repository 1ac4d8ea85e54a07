"""Oracle models on tiny datasets of every supported layout, and the error messages."""

import random

import numpy as np
import pytest
import torch
from evalutils import OracleModel, number_tokenizer, png, to_tensor, write_flat, write_karpathy, write_wds

from infclip.eval import EvalConfig, EvalConfigError, EvalTaskConfig, check_tasks, due_tasks, run_evals
from infclip.eval.data import DataError

CLASSES = [f"item {i}" for i in range(10)]


def evaluate(model, *tasks, **kw):
    cfg = EvalConfig(tasks=list(tasks), batch_size=kw.pop("batch_size", 7), workers=kw.pop("workers", 0),
                     chunk_size=kw.pop("chunk_size", 5))
    device = kw.pop("device", "cpu")
    return run_evals(model, number_tokenizer, to_tensor, cfg, step=0, final=True, device=device, **kw)


def zs_task(root, **kw):
    return EvalTaskConfig(**{"name": "zs", "kind": "zeroshot", "format": "wds", "root": str(root), **kw})


def test_oracle_zeroshot_scores_100(tmp_path):
    labels = [i % 10 for i in range(23)]
    write_wds(str(tmp_path), labels, CLASSES)
    m = evaluate(OracleModel(), zs_task(tmp_path))
    assert m["eval/zs/top1"] == m["eval/zs/top5"] == m["eval/zs/mean_per_class_recall"] == 1.0
    assert m["eval/zs/num_samples"] == 23 and m["eval/zs/top1_chance"] == pytest.approx(0.1)
    assert m["eval/zs/top5_chance"] == pytest.approx(0.5)


def test_shuffled_zeroshot_is_near_chance(tmp_path):
    gen = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 10, (200,), generator=gen).tolist()
    ids = torch.randint(0, 10, (200,), generator=gen).tolist()  # images show a random class
    write_wds(str(tmp_path), labels, CLASSES, shard_size=64, image_ids=ids)
    m = evaluate(OracleModel(), zs_task(tmp_path), batch_size=64, chunk_size=50)
    assert abs(m["eval/zs/top1"] - 0.1) < 0.06 and abs(m["eval/zs/top5"] - 0.5) < 0.1


def test_collapsed_model_scores_exactly_chance(tmp_path):
    write_wds(str(tmp_path / "zs"), [i % 10 for i in range(20)], CLASSES)
    write_flat(str(tmp_path / "rt"), 12, caps=3)
    rt = EvalTaskConfig(name="rt", kind="retrieval", format="flat", root=str(tmp_path / "rt"))
    m = evaluate(OracleModel(collapse=True), zs_task(tmp_path / "zs"), rt)
    for key in ("zs/top1", "zs/top5", "rt/i2t_r1", "rt/i2t_r5", "rt/t2i_r1", "rt/t2i_r10"):
        assert m[f"eval/{key}"] == pytest.approx(m[f"eval/{key}_chance"], abs=1e-12), key


def test_karpathy_retrieval_oracle_and_split(tmp_path):
    write_karpathy(str(tmp_path), n_test=12, n_train=4)
    task = EvalTaskConfig(name="coco", kind="retrieval", format="karpathy", root=str(tmp_path),
                          annotations="dataset_coco.json", split="test")
    m = evaluate(OracleModel(), task)
    assert m["eval/coco/num_images"] == 12 and m["eval/coco/num_texts"] == 60  # train split excluded
    assert all(m[f"eval/coco/{d}_r{k}"] == 1.0 for d in ("i2t", "t2i") for k in (1, 5, 10))
    assert m["eval/coco/t2i_r1_chance"] == pytest.approx(1 / 12)


def test_shuffled_retrieval_is_near_chance(tmp_path):
    write_flat(str(tmp_path), 30, caps=5)
    perm = torch.randperm(30, generator=torch.Generator().manual_seed(0)).tolist() + [30, 31]
    task = EvalTaskConfig(name="rt", kind="retrieval", format="flat", root=str(tmp_path))
    m = evaluate(OracleModel(image_map=perm), task)
    fixed = sum(perm[i] == i for i in range(30)) / 30
    assert m["eval/rt/i2t_r1"] == pytest.approx(fixed) and m["eval/rt/t2i_r1"] == pytest.approx(fixed)
    assert m["eval/rt/t2i_r10"] < 0.5 and m["eval/rt/i2t_r10"] < 0.5


def test_imagefolder_zeroshot_with_folder_names(tmp_path):
    for ident in (0, 1, 2, 10, 11):  # sorted folder order "item 0, item 1, item 10, ..." != numeric
        folder = tmp_path / f"item {ident}"
        folder.mkdir()
        for j in range(3):
            (folder / f"{j}.png").write_bytes(png(ident, j))
    task = EvalTaskConfig(name="folder", kind="zeroshot", format="imagefolder", root=str(tmp_path))
    m = evaluate(OracleModel(), task)
    assert m["eval/folder/top1"] == 1.0 and m["eval/folder/num_samples"] == 15
    assert m["eval/folder/num_classes"] == 5


def test_hook_schedule_state_and_rng_untouched(tmp_path):
    write_wds(str(tmp_path), list(range(10)), CLASSES)
    model = OracleModel().train()
    model.dropout.eval()  # like a frozen LiT tower: must stay in eval mode afterwards
    cfg = EvalConfig(tasks=[zs_task(tmp_path, every_n_steps=5)], batch_size=4, workers=1)
    assert [t.name for _, t in due_tasks(cfg, 10, False)] == ["zs"] and due_tasks(cfg, 7, False) == []
    torch.manual_seed(123)
    random.seed(1)
    np.random.seed(2)
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(123)
    random.seed(1)
    np.random.seed(2)
    assert run_evals(model, number_tokenizer, to_tensor, cfg, step=7, final=False, device="cpu") == {}
    m = run_evals(model, number_tokenizer, to_tensor, cfg, step=10, final=False, device="cpu")
    assert m["eval/zs/top1"] == 1.0
    after = (torch.rand(3), random.random(), np.random.rand())  # the eval consumed no random number
    assert torch.equal(after[0], expected[0]) and after[1:] == expected[1:]
    assert model.training and not model.dropout.training


def test_rank0_only_mode_skips_other_ranks(tmp_path):
    write_wds(str(tmp_path), list(range(10)), CLASSES)
    cfg = EvalConfig(tasks=[zs_task(tmp_path)], workers=0, all_ranks=False)
    # rank 1 returns at once without touching a process group (none exists here)
    assert run_evals(OracleModel(), number_tokenizer, to_tensor, cfg, step=0, final=True, device="cpu",
                     rank=1, world_size=2) == {}


# -- errors name the config key ----------------------------------------------------------------


def test_missing_root_names_key(tmp_path):
    with pytest.raises(DataError, match=r"eval\.tasks\[0\]\.root .*'zs'.*does not exist"):
        evaluate(OracleModel(), zs_task(tmp_path / "nope"))
    write_wds(str(tmp_path / "ok"), [0, 1], CLASSES)
    cfg = EvalConfig(tasks=[zs_task(tmp_path / "ok"), zs_task(tmp_path / "nope", name="zs2")])
    with pytest.raises(DataError, match=r"eval\.tasks\[1\]\.root .*'zs2'"):
        check_tasks(cfg)  # at startup, without a model


def test_missing_annotation_file_names_key(tmp_path):
    task = EvalTaskConfig(name="coco", kind="retrieval", format="karpathy", root=str(tmp_path))
    with pytest.raises(DataError, match=r"eval\.tasks\[0\]\.annotations.*dataset_coco\.json.*not found"):
        evaluate(OracleModel(), task)


def test_classname_count_mismatch_names_key(tmp_path):
    write_wds(str(tmp_path), [0, 1, 5], CLASSES[:3])  # label 5 with only 3 class names
    with pytest.raises(DataError, match=r"eval\.tasks\[0\]\.classnames.*3 class names but label 5"):
        evaluate(OracleModel(), zs_task(tmp_path))


def test_empty_dataset_names_key(tmp_path):
    write_wds(str(tmp_path), [], CLASSES)
    (tmp_path / "test" / "nshards.txt").write_text("1\n")
    import tarfile

    tarfile.open(tmp_path / "test" / "0.tar", "w").close()
    with pytest.raises(DataError, match=r"eval\.tasks\[0\]\.root.*empty"):
        evaluate(OracleModel(), zs_task(tmp_path))
    write_karpathy(str(tmp_path / "k"), n_test=0, n_train=2)
    task = EvalTaskConfig(name="k", kind="retrieval", format="karpathy", root=str(tmp_path / "k"))
    with pytest.raises(DataError, match=r"annotations.*holds no images"):
        evaluate(OracleModel(), task)


def test_missing_images_and_bad_templates(tmp_path):
    write_flat(str(tmp_path), 3)
    task = EvalTaskConfig(name="rt", kind="retrieval", format="flat", annotations=str(tmp_path / "test.json"),
                          root=str(tmp_path / "elsewhere"))
    with pytest.raises(DataError, match=r"eval\.tasks\[0\]\.root.*not found"):
        evaluate(OracleModel(), task)
    write_wds(str(tmp_path / "zs"), [0, 1], CLASSES, templates=["no placeholder"])
    with pytest.raises(DataError, match=r"templates.*placeholder"):
        evaluate(OracleModel(), zs_task(tmp_path / "zs"))


def test_invalid_task_config_is_rejected():
    bad = EvalTaskConfig(name="x", kind="retrieval", format="imagefolder")
    with pytest.raises(EvalConfigError, match=r"eval\.tasks\[0\]\.format='imagefolder'.*flat"):
        evaluate(OracleModel(), bad)
    with pytest.raises(EvalConfigError, match="unique"):
        evaluate(OracleModel(), zs_task("a"), zs_task("b"))


def test_hydra_node_config_and_brace_templates(tmp_path):
    """An OmegaConf EvalConfig node (as Hydra builds it) works; "{}" templates work like "{c}"."""
    from omegaconf import OmegaConf

    write_wds(str(tmp_path), [i % 10 for i in range(12)], CLASSES, templates=["{} photo", "art of {c}"])
    node = OmegaConf.structured(EvalConfig(tasks=[zs_task(tmp_path)], workers=0))
    m = run_evals(OracleModel(), number_tokenizer, to_tensor, node, step=0, final=True, device="cpu")
    assert m["eval/zs/top1"] == 1.0


def test_max_samples_takes_the_first_images(tmp_path):
    write_wds(str(tmp_path), [i % 10 for i in range(23)], CLASSES, shard_size=4)
    m = evaluate(OracleModel(), zs_task(tmp_path, max_samples=6))
    assert m["eval/zs/num_samples"] == 6 and m["eval/zs/top1"] == 1.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CPU counterpart: the tests above)")
def test_cuda_bf16_oracle_keeps_cuda_rng(tmp_path):
    from infclip.eval import make_autocast

    write_wds(str(tmp_path / "zs"), [i % 10 for i in range(23)], CLASSES)
    write_flat(str(tmp_path / "rt"), 12, caps=3)
    rt = EvalTaskConfig(name="rt", kind="retrieval", format="flat", root=str(tmp_path / "rt"))
    cuda_state = torch.cuda.get_rng_state()
    m = evaluate(OracleModel().cuda(), zs_task(tmp_path / "zs"), rt, device="cuda",
                 autocast=make_autocast("bf16", "cuda"))
    assert m["eval/zs/top1"] == 1.0 and m["eval/rt/i2t_r1"] == 1.0 and m["eval/rt/t2i_r1"] == 1.0
    assert torch.equal(torch.cuda.get_rng_state(), cuda_state)
