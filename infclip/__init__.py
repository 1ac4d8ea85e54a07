"""InfCLIP: contrastive training at million-sample batches.

Layering: ``infclip.kernels`` (Triton, no infclip imports) <- ``infclip.loss``
(autograd-level losses, ring communication) <- ``infclip.train`` (engine, loop).
``infclip.data`` and ``infclip.eval`` depend on models and data only.
"""

import os as _os

__version__ = "0.1.0"

# The repo's top-level ``kernels/`` folder is installed as ``infclip.kernels`` (pyproject's
# package-dir). When this package is imported from a source checkout instead -- e.g.
# ``python train.py`` from the repo root, where the checkout shadows an installed copy --
# the repo root joins this package's search path so ``infclip.kernels`` still resolves
# (only names absent from infclip/ itself can come from there).
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "kernels", "__init__.py")) and _root not in __path__:
    __path__.append(_root)
