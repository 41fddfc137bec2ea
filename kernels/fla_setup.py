"""Pinned flash-linear-attention kernel configs, so a first training step does not autotune.

fla tunes every Triton kernel on first use (minutes on an H200; the causal convolution alone
took 94 s). HARTS ships configs tuned once per GPU by ``benchmarks/tune_fla.py`` in
``fla_configs/<GPU>/`` and points fla at them through fla's own config-cache mechanism
(``FLA_CACHE_MODE=fuzzy``, ``FLA_CONFIG_DIR``) before fla is first imported. Every fla-based
kernel module of :mod:`harts.kernels` calls :func:`configure_fla` before its fla import.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

__all__ = ["CONFIG_ROOT", "configure_fla"]

CONFIG_ROOT = Path(__file__).resolve().parent / "fla_configs"


def _gpu_config_name(device: torch.device) -> str:
    return re.sub(r"[^0-9A-Za-z]+", "_", torch.cuda.get_device_name(device)).strip("_") or "unknown_gpu"


def configure_fla(device: torch.device | None = None) -> Path | None:
    """Point fla at HARTS' pinned kernel configs for this GPU (call before fla is imported).

    Returns the config directory used, or None when the user configured fla already or no
    configs ship for this GPU (fla then autotunes as usual).
    """
    if "FLA_CACHE_MODE" in os.environ or "FLA_CONFIG_DIR" in os.environ:
        return None
    if not torch.cuda.is_available():
        return None
    directory = CONFIG_ROOT / _gpu_config_name(device or torch.device("cuda"))
    if not directory.is_dir():
        logger.info("no pinned fla configs for %s; fla will autotune on first use", directory.name)
        return None
    # fuzzy: a config tuned for one shape serves every shape of the same dtypes; an untuned
    # dtype still autotunes rather than running a config that may not fit it
    os.environ["FLA_CACHE_MODE"] = "fuzzy"
    os.environ["FLA_CONFIG_DIR"] = str(directory)
    return directory
