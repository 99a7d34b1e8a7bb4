"""Optimizer kernels used by protrain_core (installed as ``protrain_ops``).

The engine calls these on one chunk at a time: lists of flat fp32 (bf16 in bf16-true) views
(master weights, gradients, Adam moments) that live either on the device (persistent chunks) or in host
memory (non-persistent chunks, updated by the CPU worker).
"""

from protrain_ops import onepass
from protrain_ops.adam import AdamHyperParams, adam_step, clip_gradients, copy_to_low_precision, fold_landing

__all__ = ["AdamHyperParams", "adam_step", "clip_gradients", "copy_to_low_precision", "fold_landing", "onepass"]
