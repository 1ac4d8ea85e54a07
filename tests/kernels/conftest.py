"""Kernel tests run on CPU through Triton's interpreter when no GPU is present.

TRITON_INTERPRET must be set before ``triton`` decorates the kernels (at import of
``infclip.kernels.clip``), so it is set here, at conftest import time.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
