"""Fused Triton kernels, installed as ``infclip.kernels``.

This folder must never be importable as a top-level ``kernels`` package (that name
belongs to Hugging Face's ``kernels``, which transformers probes for). Import it as
``infclip.kernels``. Nothing here imports from the rest of ``infclip``.
"""
