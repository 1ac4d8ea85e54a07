"""InfCLIP: contrastive training at million-sample batches.

Layering: ``infclip.kernels`` (Triton, no infclip imports) <- ``infclip.loss``
(autograd-level losses, ring communication) <- ``infclip.train`` (engine, loop).
``infclip.data`` and ``infclip.eval`` depend on models and data only.
"""

__version__ = "0.1.0"
