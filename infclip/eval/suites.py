"""Benchmark suites: named lists of clip_benchmark webdataset datasets, found under ``data_root``.

``python -m infclip.eval checkpoint=RUN tasks=[datacomp] data_root=/datasets`` evaluates every
dataset of the suite present as ``<data_root>/wds_<name>/`` (clip_benchmark's wds layout: the
Hugging Face ``clip-benchmark/wds_<name>`` repositories downloaded as they are, ``/`` in a
dataset name written as ``-``), skips the missing ones with one line each, and reports each
dataset's main metric and the suite average (the mean of the main metrics, as DataComp
reports it; over the datasets found, which the table states). Nothing is downloaded.

Main metrics: ``top1``; ``mean_per_class_recall`` where DataComp uses it (Caltech-101, FGVC
Aircraft, Flowers-102, Pets); retrieval ``mean_r1`` = (image->text R@1 + text->image R@1) / 2.
Not included (other data or metrics): VOC2007 multilabel (mAP), and DataComp's WinoGAViL,
WILDS and fairness tasks (worst-group metrics need group labels).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from infclip.eval.config import EvalTaskConfig


@dataclass(frozen=True)
class SuiteDataset:
    """One dataset of a suite: its clip_benchmark name, task kind and main metric."""

    dataset: str  # clip_benchmark name, e.g. "vtab/cifar100"
    kind: str = "zeroshot"  # "zeroshot" | "retrieval"
    metric: str = "top1"  # main metric key of this dataset's results

    @property
    def name(self) -> str:
        """Task name (metric keys eval/<name>/...): the dataset name with '/' -> '-'."""
        return self.dataset.replace("/", "-")

    @property
    def folder(self) -> str:
        """Folder under data_root: clip_benchmark's ``wds_{dataset_cleaned}``."""
        return f"wds_{self.name}"


def _zs(*names: str, metric: str = "top1") -> list[SuiteDataset]:
    return [SuiteDataset(n, "zeroshot", metric) for n in names]


_VTAB = ("vtab/caltech101", "vtab/cifar10", "vtab/cifar100", "vtab/clevr_count_all",
         "vtab/clevr_closest_object_distance", "vtab/diabetic_retinopathy", "vtab/dmlab",
         "vtab/dsprites_label_orientation", "vtab/dsprites_label_x_position", "vtab/dtd", "vtab/eurosat",
         "vtab/kitti_closest_vehicle_distance", "vtab/flowers", "vtab/pets", "vtab/pcam", "vtab/resisc45",
         "vtab/smallnorb_label_azimuth", "vtab/smallnorb_label_elevation", "vtab/svhn")
_MPCR = "mean_per_class_recall"
_RETRIEVAL = [SuiteDataset("flickr30k", "retrieval", "mean_r1"),
              SuiteDataset("mscoco_captions", "retrieval", "mean_r1")]

SUITES: dict[str, list[SuiteDataset]] = {
    # clip_benchmark 1.6.2's "vtab+" collection (its voc2007_multilabel left out: mAP, not top-1)
    "vtab_plus": _zs("imagenet1k", "imagenetv2", "imagenet_sketch", "imagenet-a", "imagenet-r", "objectnet",
                     "fer2013", "voc2007", "sun397", "cars", "fgvc_aircraft", "mnist", "stl10", "gtsrb",
                     "country211", "renderedsst2", *_VTAB),
    # DataComp's classification and retrieval tasks (tasklist.yml) with their main metrics
    "datacomp": [
        *_zs("vtab/caltech101", metric=_MPCR),
        *_zs("cifar10", "vtab/cifar100", "vtab/clevr_count_all", "vtab/clevr_closest_object_distance",
             "country211", "vtab/dtd", "vtab/eurosat"),
        *_zs("fgvc_aircraft", metric=_MPCR),
        *_zs("food101", "gtsrb", "imagenet1k", "imagenet_sketch", "imagenetv2", "imagenet-a", "imagenet-o",
             "imagenet-r", "vtab/kitti_closest_vehicle_distance", "mnist", "objectnet"),
        *_zs("vtab/flowers", "vtab/pets", metric=_MPCR),
        *_zs("voc2007", "vtab/pcam", "renderedsst2", "vtab/resisc45", "cars", "stl10", "sun397", "vtab/svhn"),
        *_RETRIEVAL,
    ],
    "imagenet_robustness": _zs("imagenetv2", "imagenet_sketch", "imagenet-a", "imagenet-r", "objectnet"),
    "retrieval": [*_RETRIEVAL, SuiteDataset("flickr8k", "retrieval", "mean_r1")],
}


@dataclass
class SuitePlan:
    """A suite on this machine: the datasets found (in suite order) and the missing ones."""

    name: str
    found: list[SuiteDataset]
    missing: list[tuple[SuiteDataset, str]]  # (dataset, the folder looked for)


def plan_suite(name: str, data_root: str, split: str = "test") -> tuple[SuitePlan, list[EvalTaskConfig]]:
    """The suite's datasets present under ``data_root`` and their task configs."""
    found, missing, tasks = [], [], []
    for ds in SUITES[name]:
        root = os.path.join(data_root, ds.folder)
        if not os.path.isdir(os.path.join(root, split)):
            missing.append((ds, root))
            continue
        found.append(ds)
        tasks.append(EvalTaskConfig(name=ds.name, kind=ds.kind, root=root, format="wds", split=split))
    return SuitePlan(name, found, missing), tasks


def main_metric(ds: SuiteDataset, metrics: dict[str, float]) -> float:
    """The dataset's main metric from the flat ``eval/<task>/<metric>`` results."""
    key = f"eval/{ds.name}"
    if ds.metric == "mean_r1":
        return (metrics[f"{key}/i2t_r1"] + metrics[f"{key}/t2i_r1"]) / 2
    return metrics[f"{key}/{ds.metric}"]


def summarize(plan: SuitePlan, metrics: dict[str, float]) -> dict[str, float]:
    """``eval/<suite>/<dataset>`` main metrics, ``eval/<suite>/average`` and dataset counts."""
    out = {f"eval/{plan.name}/{ds.name}": main_metric(ds, metrics) for ds in plan.found}
    if plan.found:
        out[f"eval/{plan.name}/average"] = sum(out.values()) / len(plan.found)
    out[f"eval/{plan.name}/num_datasets"] = float(len(plan.found))
    out[f"eval/{plan.name}/num_missing"] = float(len(plan.missing))
    return out


def format_suite(plan: SuitePlan, summary: dict[str, float]) -> str:
    """The suite table: one row per dataset found (main metric, percent), then the average."""
    total = len(plan.found) + len(plan.missing)
    lines = [f"== suite {plan.name}: {len(plan.found)} of {total} datasets found",
             f"{'dataset':<40} {'metric':<24} {'value %':>9}"]
    for ds in plan.found:
        lines.append(f"{ds.name:<40} {ds.metric:<24} {100 * summary[f'eval/{plan.name}/{ds.name}']:9.2f}")
    average: Optional[float] = summary.get(f"eval/{plan.name}/average")
    if average is not None:
        note = "" if not plan.missing else f"  (over the {len(plan.found)} found; not the full suite's)"
        lines.append(f"{'average':<40} {'':<24} {100 * average:9.2f}{note}")
    return "\n".join(lines)
