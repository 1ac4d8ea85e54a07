"""Zero-shot classification and image-text retrieval evaluation.

Training calls :func:`run_evals` every N steps and at the end; ``python -m infclip.eval``
evaluates a saved checkpoint or any open_clip model (see docs/eval.md).
"""

from infclip.eval.config import EvalConfig, EvalConfigError, EvalTaskConfig, validate_eval, validate_task
from infclip.eval.runner import check_tasks, due_tasks, make_autocast, run_evals

__all__ = [
    "EvalConfig", "EvalTaskConfig", "EvalConfigError", "validate_eval", "validate_task",
    "run_evals", "check_tasks", "due_tasks", "make_autocast",
]
