"""Shared test setup: no wandb, no network, small thread pools on the 2-core CI machine.

Without a GPU, Triton kernels run through Triton's interpreter. TRITON_INTERPRET must be
set before any module decorates a kernel (``infclip.kernels`` may be imported by any
test module, in any order), so it is set here, in the root conftest, first of all.
"""

import os

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch  # noqa: E402  (after the environment above)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
