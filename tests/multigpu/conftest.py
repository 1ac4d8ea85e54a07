"""The NCCL tier (``scripts/gpu_tests/run.sh OUT --multi``): runs only where two or more CUDA GPUs
are visible; CPU machines run the same code paths over gloo (tests/loss, tests/train)."""
