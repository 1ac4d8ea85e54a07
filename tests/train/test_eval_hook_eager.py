"""The trainer's eval hook runs towers compiled by ``model.compile=true`` eagerly: the eval's
graphs (eval mode, no grad, other batch sizes) would otherwise compile anew in every process."""

from types import SimpleNamespace

import pytest
import torch

import infclip.eval
from infclip.model import compile_towers
from infclip.train.evaluation import evaluate


class _Towers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.visual = torch.nn.Linear(4, 3)
        self.text = torch.nn.Linear(6, 3)  # not the image tower's shapes: a graph of its own


def _parts(model: torch.nn.Module, logged: list) -> SimpleNamespace:
    return SimpleNamespace(
        eval_cfg=SimpleNamespace(tasks=[object()]), guard=None, model=model,
        built=SimpleNamespace(tokenizer=None, preprocess_val=None),
        logger=SimpleNamespace(log=lambda step, results: logged.append((step, results))))


@pytest.mark.skipif(not hasattr(torch.compiler, "set_stance"), reason="torch < 2.6 has no compile stance")
def test_compiled_towers_run_eagerly_in_the_eval_hook_and_compiled_after(monkeypatch):
    compiled = []

    def backend(gm, example_inputs):  # counts compilations, runs the captured graph as it is
        compiled.append(gm)
        return gm.forward

    model = _Towers()
    assert compile_towers(model, backend=backend) == ["visual", "text"]
    x = torch.randn(5, 4)
    model.visual(x)
    assert len(compiled) == 1  # the training graph

    seen = {}

    def run_evals(m, tokenizer, preprocess, cfg, **kw):
        m.eval()
        with torch.no_grad():  # eval mode, no grad, two new batch sizes: three new graphs if compiled
            out = [m.visual(torch.randn(n, 4)) for n in (7, 3)] + [m.text(torch.randn(7, 6))]
        seen["outs"] = out
        return {"eval/toy/top1": 1.0}

    monkeypatch.setattr(infclip.eval, "run_evals", run_evals)
    cfg = SimpleNamespace(loss=SimpleNamespace(kind="clip", impl="torch", fp32_precision="ieee", temperature=None),
                          precision=SimpleNamespace(amp="fp32"))
    info = SimpleNamespace(device=torch.device("cpu"), rank=0, world_size=1, distributed=False, is_main=True)
    logged = []
    assert evaluate(cfg, info, _parts(model, logged), step=3, final=False) == {"eval/toy/top1": 1.0}
    assert logged == [(3, {"eval/toy/top1": 1.0})] and len(seen["outs"]) == 3
    assert len(compiled) == 1, "the eval compiled graphs of the towers"
    model.train()
    model.text(torch.randn(5, 6))  # outside the eval the compiled towers run compiled again
    assert len(compiled) == 2
