"""Build the run's model from a spec string, the same way on shards and workers.

A spec is either a built-in GPT preset name (nano, tiny, small, medium, large) or an import path
`package.module:factory`, where `factory()` returns a torch.nn.Module. The built-in presets are reached by
import path too (streamdiloco.worker.model), so that common/ and server/ need no static import of worker/.
Both sides seed PyTorch with the run's seed before calling the factory. Torch is imported by build_model
only: model_factory checks a spec for the command line before it imports torch.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

BUILTIN_MODULE = "streamdiloco.worker.model"
BUILTIN_PRESETS = ("nano", "tiny", "small", "medium", "large")


def build_model(spec: str, seed: int = 0, block_size: int | None = None) -> nn.Module:
    import torch

    torch.manual_seed(seed)
    factory = model_factory(spec)
    if factory is None:
        builtin = importlib.import_module(BUILTIN_MODULE)
        return builtin.build_gpt(spec, **({"block_size": block_size} if block_size else {}))
    model = factory()
    if not isinstance(model, torch.nn.Module):
        name = spec.partition(":")[2]
        raise ValueError(f"--model {spec!r}: {name}() returned {type(model).__name__}, not a torch.nn.Module")
    return model


def model_factory(spec: str) -> Callable[[], nn.Module] | None:
    """The factory a `module.path:factory` spec names (None for a built-in preset), or a one-line ValueError:
    checked without building the model, and without importing torch unless the spec's module does (the
    command line checks --model so before it imports torch)."""
    if spec in BUILTIN_PRESETS:
        return None
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"--model {spec!r}: give a built-in preset ({', '.join(BUILTIN_PRESETS)}) or module.path:factory"
        )
    if os.getcwd() not in sys.path:  # modules in the working directory import (after installed ones)
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"--model {spec!r}: cannot import {module_name!r} ({e})") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"--model {spec!r}: {module_name} has no callable {attr!r}")
    return factory


def model_block_size(model: nn.Module, override: int | None = None, default: int = 128) -> int:
    """Context length for the data pipeline: the flag, else the model's config.block_size, else 128."""
    return override or getattr(getattr(model, "config", None), "block_size", None) or default
