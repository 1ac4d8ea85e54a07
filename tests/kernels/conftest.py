"""Kernel tests run on CPU through Triton's interpreter when no GPU is present.

TRITON_INTERPRET must be set before ``triton`` decorates the kernels (at import of
``infclip.kernels.clip``), so it is set here, at conftest import time.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def small_strips(monkeypatch):
    """A 16-row strip scratch for the objective kernels' test shapes (their strip backward
    takes max(budget rows, STRIP_MIN_ROWS) rows): several strips and a ragged last one."""
    from infclip.kernels.clip import launch

    monkeypatch.setattr(launch, "STRIP_BUDGET_BYTES", 4 * 64 * 16)
    monkeypatch.setattr(launch, "STRIP_BYTES_PER_COLUMN", 0)
    monkeypatch.setattr(launch, "STRIP_MIN_ROWS", 16)
    monkeypatch.setattr(launch, "STRIP_TEMP_BYTES", 0)  # the folded positives' scratch takes its room


@pytest.fixture
def products(monkeypatch):
    """Shapes of the strip products P @ b (``launching.product_into``) made from now on: which
    feature gradients a backward formed (the locked-side tests)."""
    from infclip.kernels import launching

    made = []
    real = launching.product_into
    monkeypatch.setattr(launching, "product_into", lambda *a, **k: made.append(tuple(a[0].shape)) or real(*a, **k))
    return made
