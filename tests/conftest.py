"""Shared test setup: no wandb, no network, small thread pools on the 2-core CI machine.

Without a GPU, Triton kernels run through Triton's interpreter. TRITON_INTERPRET must be
set before any module decorates a kernel (``infclip.kernels`` may be imported by any
test module, in any order), so it is set here, in the root conftest, first of all.
"""

import os

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "2")

import sys  # noqa: E402

import torch  # noqa: E402  (after the environment above)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests_pairwise

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# -- the GPU tier's cut of the parametrizations (scripts/gpu_tests/run.sh) --------------------


def pytest_addoption(parser):
    parser.addoption(
        "--pairwise", action="store_true",
        help="of each parametrized test, keep only cases until every pair of parameter values "
             "(and every single value) has run once; the GPU tier's quick cut")


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--pairwise"):
        return
    from tests_pairwise import pairwise_subset

    kept = pairwise_subset(items)
    dropped = [item for item in items if item not in kept]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if item in kept]
