"""Undecodable eval images (a corrupt JPEG, a FIFO) are skipped and counted, never hang the
evaluation, and its loader workers never outlive it."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from evalutils import OracleModel, number_tokenizer, png, to_tensor

from infclip.eval import EvalConfig, EvalTaskConfig, run_evals
from infclip.eval.cli import nonfinite_warnings


def _evaluate(task, workers=2):
    cfg = EvalConfig(tasks=[task], batch_size=2, workers=workers)
    return run_evals(OracleModel(), number_tokenizer, to_tensor, cfg, step=0, final=True, device="cpu")


def _garbage(path):
    path.write_bytes(b"\xff\xd8\xff\xe0" + os.urandom(3000))  # a JPEG header, then noise


@pytest.mark.timeout(120)
def test_a_corrupt_image_and_a_fifo_in_a_folder_are_skipped_and_counted(tmp_path):
    for ident in range(3):
        (tmp_path / f"item {ident}").mkdir()
        for j in range(2):
            (tmp_path / f"item {ident}" / f"{j}.png").write_bytes(png(ident, j))
    _garbage(tmp_path / "item 0" / "bad.jpg")
    os.mkfifo(tmp_path / "item 1" / "fifo.png")  # opening it would block forever
    task = EvalTaskConfig(name="f", kind="zeroshot", format="imagefolder", root=str(tmp_path))
    m = _evaluate(task)
    assert m["eval/f/top1"] == 1.0 and m["eval/f/num_samples"] == 6
    assert m["eval/f/num_skipped_images"] == 1
    assert nonfinite_warnings(m) == [
        "warning: f: 1 images could not be read or decoded (damaged, not an image, or not a regular file); "
        "skipped: the metrics are those of the others"]


@pytest.mark.timeout(120)
def test_retrieval_leaves_out_undecodable_images_and_their_captions(tmp_path):
    (tmp_path / "images").mkdir()
    records = []
    for k in range(5):
        (tmp_path / "images" / f"{k}.png").write_bytes(png(k, k))
        records.append({"image": f"images/{k}.png", "caption": [f"item {k} take {j}" for j in range(2)]})
    _garbage(tmp_path / "images" / "2.png")
    os.remove(tmp_path / "images" / "4.png")
    os.mkfifo(tmp_path / "images" / "4.png")
    (tmp_path / "test.json").write_text(json.dumps(records))
    task = EvalTaskConfig(name="r", kind="retrieval", format="flat", root=str(tmp_path), annotations="test.json")
    m = _evaluate(task)
    assert m["eval/r/num_skipped_images"] == 2
    assert m["eval/r/num_images"] == 3 and m["eval/r/num_texts"] == 6
    assert m["eval/r/i2t_r1"] == 1.0 and m["eval/r/t2i_r1"] == 1.0


_STUCK = textwrap.dedent("""
    import os, sys, time
    import torch
    from infclip.eval.data import ImageList
    from infclip.eval.embed import Runtime, encode_images

    def stuck(img):  # a decode that never returns (a hung NFS read)
        open(os.path.join(sys.argv[1], f"worker.{os.getpid()}"), "w").close()
        time.sleep(600)

    refs = [sys.argv[2]] * 8
    encode_images(None, ImageList(refs, [0] * 8, stuck), range(8), None, 1, 2, Runtime(torch.device("cpu")))
""")


@pytest.mark.timeout(120)
def test_eval_loader_workers_die_with_their_process(tmp_path):
    """SIGKILL (or any end) of the evaluating process takes its loader workers with it, even
    while they are stuck in a read; they ignore SIGTERM, so nothing else would end them."""
    image = tmp_path / "a.png"
    image.write_bytes(png(1))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", _STUCK, str(tmp_path), str(image)], env=env)
    deadline = time.monotonic() + 90
    while len(list(tmp_path.glob("worker.*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    pids = [int(p.name.split(".")[1]) for p in tmp_path.glob("worker.*")]
    assert len(pids) == 2, "the workers never started"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = [p for p in pids if _alive(p)]
    for p in alive:
        os.kill(p, signal.SIGKILL)
    assert not alive, f"loader workers {alive} outlived their process"


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
