"""Operator kernels of the HARTS runtime (the package ``harts.kernels``), one folder per operator.

Laid out as flash-linear-attention lays out its ops: each operator has a pure-torch
``naive.py`` reference (CPU, float64-capable, differentiable) beside its fast GPU version,
and the tests hold every fast path to its reference, forward and backward.

* ``linear_attention/``: packed varlen chunkwise gated delta rule (KDA per-key-channel decay,
  Gated DeltaNet per-head decay) with initial states and exported chunk-boundary states.
  ``naive`` (reference and the token-by-token oracle), ``chunk`` (fla's KDA pipeline with our
  state kernels), ``state`` (those Triton kernels: fp32 exports in the forward scan, exported-
  state gradients injected into the reverse scan);
* ``conv/``: packed varlen depthwise causal convolution with per-sequence context;
* ``attention/``: packed softmax attention with separate query and key spans, bottom-right
  causal (``naive``, ``varlen`` FlashAttention-2, ``tree_mask`` FlexAttention over one KV buffer);
* ``moe/``: routed SwiGLU experts (``naive`` per expert, ``grouped`` grouped GEMMs);
* ``head/``: row statistics of the log-prob head's logit blocks (``naive`` torch ops, ``softmax``
  Triton: log-sum-exp and entropy in one pass, the logits' gradient in place);
* ``rows/``: row packing between compact rows and the sequence kernels' packed inputs
  (``naive`` index_select / cat, ``packed`` the generated programs' modules, whose backward
  writes each row's gradient once).

:mod:`harts.kernels.interface` declares the interface (:class:`~.interface.Kernels`, one
protocol per operator) that :mod:`harts.kernels.naive` (the references in one namespace),
:mod:`harts.kernels.dispatch` (the fast path per call, see :class:`~.dispatch.Dispatch`) and
every operator implementation follow.
"""

import sys


def _hand_the_name_to_the_installed_distribution() -> bool:
    """From a source checkout's root (its tests, benchmarks and scripts put the root on ``sys.path``) this
    folder is importable as a top-level ``kernels``, and it would hide the Hugging Face ``kernels``
    distribution that transformers (5.25 on) imports under that name. HARTS imports this folder only as
    ``harts.kernels``; a top-level import gets the installed distribution when one exists."""
    import importlib.machinery
    import importlib.util
    import os

    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    elsewhere = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != checkout]
    spec = importlib.machinery.PathFinder.find_spec(__name__, elsewhere)
    if spec is None or spec.loader is None:
        return False
    module = importlib.util.module_from_spec(spec)
    sys.modules[__name__] = module
    spec.loader.exec_module(module)
    return True


if __name__ != "kernels" or not _hand_the_name_to_the_installed_distribution():
    from . import dispatch, interface, naive
    from .dispatch import Dispatch
    from .interface import Kernels

__all__ = ["Dispatch", "Kernels", "dispatch", "interface", "naive"]
