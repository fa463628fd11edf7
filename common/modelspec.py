"""Build the run's model from a spec string, the same way on shards and workers.

A spec is a built-in GPT preset name (nano, tiny, small, medium, large), an import path
`package.module:factory` whose `factory()` returns a torch.nn.Module, or `hf:PATH`: a Hugging Face
transformers causal language model built from a local config (PATH a folder with config.json, as
`save_pretrained` writes it, or a config JSON file), with the folder's safetensors weights where it has
them, else a random init. The built-in presets are reached by import path too (streamdiloco.worker.model),
so that common/ and server/ need no static import of worker/.

Both sides seed PyTorch with the run's seed before building, so a random init is the same everywhere (the
shards' initial masters and every worker's). An `hf:` model is an instance of a subclass of the class the
config names (GPT2LMHeadModel, LlamaForCausalLM, ...) that only overrides `forward(idx, targets) ->
(logits, loss)`, the worker loop's contract; its parameter names and its `save_pretrained` are the model's
own, so `export --hf-out` writes a folder that `AutoModelForCausalLM.from_pretrained` loads as the plain
class. Nothing is ever downloaded: local files only (`local_files_only=True`, HF_HUB_OFFLINE=1).

Torch (and transformers) are imported by build_model only: `check_spec` checks a spec for the command line
before torch is imported (a missing folder, no config.json, bad JSON: one line). Whether the config names
a causal LM needs transformers' model tables, which import torch: build_model checks that, also in one
line, before a shard or a worker goes on the network.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

BUILTIN_MODULE = "streamdiloco.worker.model"
BUILTIN_PRESETS = ("nano", "tiny", "small", "medium", "large")
HF_PREFIX = "hf:"
# what a save_pretrained folder holds its weights in (one file, or an index of shards); only safetensors are
# read: a pickled pytorch_model.bin is refused rather than run
HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
HF_PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
MAX_CONFIG_BYTES = 1 << 20  # a model's config.json is a few kilobytes
DEFAULT_HF_CONTEXT = 1024  # an hf: model's context without --block-size: its positions, at most this


def build_model(spec: str, seed: int = 0, block_size: int | None = None) -> nn.Module:
    import torch

    torch.manual_seed(seed)
    source = hf_source(spec)
    if source is not None:
        return build_hf(source, block_size)
    factory = model_factory(spec)
    if factory is None:
        builtin = importlib.import_module(BUILTIN_MODULE)
        return builtin.build_gpt(spec, **({"block_size": block_size} if block_size else {}))
    model = factory()
    if not isinstance(model, torch.nn.Module):
        name = spec.partition(":")[2]
        raise ValueError(f"--model {spec!r}: {name}() returned {type(model).__name__}, not a torch.nn.Module")
    return model


def check_spec(spec: str) -> None:
    """A one-line ValueError for a spec that cannot build, checked as far as it can be without torch: a
    preset's name, a factory that imports (its module may import torch), an hf: config that reads."""
    if hf_source(spec) is None:
        model_factory(spec)


def model_factory(spec: str) -> Callable[[], nn.Module] | None:
    """The factory a `module.path:factory` spec names (None for a built-in preset), or a one-line ValueError:
    checked without building the model, and without importing torch unless the spec's module does (the
    command line checks --model so before it imports torch). An hf: spec is hf_source's."""
    if spec in BUILTIN_PRESETS:
        return None
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"--model {spec!r}: give a built-in preset ({', '.join(BUILTIN_PRESETS)}), module.path:factory "
            "or hf:PATH (a transformers config folder or file)"
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
    """Context length for the data pipeline: the flag, else the model's config.block_size, else (a
    transformers config) its positions (n_positions, max_position_embeddings), at most DEFAULT_HF_CONTEXT,
    else 128."""
    config = getattr(model, "config", None)
    if override:
        return override
    if block := getattr(config, "block_size", None):
        return int(block)
    positions = _positions(config)
    return min(positions, DEFAULT_HF_CONTEXT) if positions else default


def model_vocab_size(model: nn.Module) -> int | None:
    """The token ids the model takes (its config's vocab_size), or None when it does not say."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None


def check_vocab(model: nn.Module, vocab_size: int, spec: str, data: str = "the data") -> None:
    """ValueError (one line) unless the model's embedding takes every token id of a vocabulary of
    `vocab_size` ids (0..vocab_size-1): the built-in text's 256 bytes, or a prepared dataset's tokenizer. A
    model that does not say its vocab_size is not checked."""
    vocab = model_vocab_size(model)
    if vocab is not None and vocab < vocab_size:
        raise ValueError(
            f"--model {spec}: its vocab_size is {vocab:,}, but {data} has token ids up to "
            f"{vocab_size - 1:,}: give a model whose vocab_size is at least {vocab_size:,}"
        )


def _positions(config: object) -> int | None:
    for key in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


# --- hf:PATH ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HFSource:
    """An `hf:PATH` spec, read: the config file, its JSON, and the folder whose weights to load (None: the
    folder has none, or PATH is a config file; the model is then a random init)."""

    spec: str
    config_file: Path
    config: dict[str, Any]
    weights_folder: Path | None


def hf_source(spec: str) -> HFSource | None:
    """The hf: spec's config, read and checked without torch (None for another kind of spec); a one-line
    ValueError for a missing path, a folder without config.json, a file that is not a JSON object with a
    model_type, or a folder whose only weights are pickles."""
    if not spec.startswith(HF_PREFIX):
        return None
    raw = spec[len(HF_PREFIX) :]
    if not raw:
        raise ValueError(
            "--model hf:PATH: give PATH, a folder with config.json (save_pretrained's) or a file"
        )
    path = Path(raw).expanduser()
    where = f"--model {spec}"
    if path.is_dir():
        config_file, folder = path / "config.json", path
        if not config_file.is_file():
            raise ValueError(
                f"{where}: {path} has no config.json (give a folder written by save_pretrained, or the "
                "config JSON file itself)"
            )
    elif path.is_file():
        config_file, folder = path, None
    else:
        raise ValueError(f"{where}: {path} does not exist (a folder with config.json, or a config JSON file)")
    try:
        with open(config_file, "rb") as f:
            text = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ValueError(f"{where}: cannot read {config_file} ({e.strerror or e})") from None
    if len(text) > MAX_CONFIG_BYTES:
        raise ValueError(f"{where}: {config_file} is over {MAX_CONFIG_BYTES:,} bytes: not a model's config")
    try:
        config = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: {config_file} is not JSON ({str(e)[:120]})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where}: {config_file} holds a JSON {type(config).__name__}, not a model's config")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ValueError(
            f"{where}: {config_file} has no model_type: not a transformers config (save_pretrained's has)"
        )
    weights = None
    if folder is not None:
        if any((folder / name).is_file() for name in HF_WEIGHTS):
            weights = folder
        elif pickled := [name for name in HF_PICKLES if (folder / name).is_file()]:
            raise ValueError(
                f"{where}: {folder} has its weights as {pickled[0]} (a pickle, which can run code): only "
                "safetensors are read; convert it with save_pretrained(..., safe_serialization=True)"
            )
    return HFSource(spec, config_file, config, weights)


_CLI_CLASSES: dict[Any, type] = {}  # one subclass per transformers class, shared by every build


def cli_class(base: Any) -> type:
    """A subclass of the transformers causal LM class `base` whose forward is the worker loop's: `forward(
    idx, targets=None) -> (logits, loss)`, the mean cross-entropy over every position (the data's targets are
    the next tokens already). Called as transformers calls its models (input_ids=..., as generate() does),
    it is `base`'s own forward. It takes `base`'s names (module, class) so that save_pretrained writes
    `architectures: [base's name]` and transformers treats it as the stock class."""
    if base in _CLI_CLASSES:
        return _CLI_CLASSES[base]
    import inspect

    import torch.nn.functional as F

    takes = inspect.signature(base.forward).parameters.values()
    # training keeps no key/value cache (memory for nothing), where the class lets us say so
    no_cache = (
        {"use_cache": False} if any(p.name == "use_cache" or p.kind is p.VAR_KEYWORD for p in takes) else {}
    )

    def forward(self, idx=None, targets=None, **kwargs):
        if idx is None or kwargs:  # transformers' own callers (generate): input_ids=..., attention_mask=...
            return base.forward(self, **({"input_ids": idx} if idx is not None else {}), **kwargs)
        logits = base.forward(self, input_ids=idx, **no_cache).logits
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    cls = type(base.__name__, (base,), {"forward": forward, "__module__": base.__module__})
    cls.__qualname__ = base.__qualname__
    _CLI_CLASSES[base] = cls
    return cls


def build_hf(source: HFSource, block_size: int | None = None) -> nn.Module:
    """The hf: spec's model (the caller seeds torch): random init from the config, or the folder's weights
    (fp32 either way: the run's parameters, optimizer and sync are fp32). One-line ValueErrors: transformers
    missing, a config it cannot read, a model type that is not a causal LM, weights that do not fit it, a
    --block-size beyond the model's positions."""
    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read when huggingface_hub is first imported: before it
    where = f"--model {source.spec}"
    try:
        import transformers
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    except ImportError:
        raise ValueError(f"{where} needs transformers: pip install 'streamdiloco[hf]'") from None
    transformers.utils.logging.disable_progress_bar()  # a bar per load and save: noise in a process's log
    try:
        config = AutoConfig.from_pretrained(
            str(source.config_file), local_files_only=True, trust_remote_code=False
        )
    except Exception as e:  # transformers raises many kinds: its first line says what
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ValueError(f"{where}: transformers cannot read {source.config_file} ({first})") from None
    try:
        base: Any = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # the class (a tuple in some other mappings)
    except KeyError:
        raise ValueError(
            f"{where}: model_type {config.model_type!r} is not a causal language model "
            "(transformers' AutoModelForCausalLM has no class for it)"
        ) from None
    positions = _positions(config)
    if block_size and positions and block_size > positions:
        raise ValueError(
            f"{where}: --block-size {block_size} is longer than the model's {positions} positions: give at "
            f"most {positions}"
        )
    cls: Any = cli_class(base[0] if isinstance(base, tuple) else base)
    if source.weights_folder is None:
        model = cls(config)
    else:
        try:
            model, info = cls.from_pretrained(
                str(source.weights_folder),
                config=config,
                dtype=torch.float32,
                local_files_only=True,
                output_loading_info=True,
            )
        except Exception as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise ValueError(
                f"{where}: cannot load the weights of {source.weights_folder} ({first})"
            ) from None
        for kind in ("missing_keys", "mismatched_keys"):
            if info.get(kind):
                names = sorted(str(k) for k in info[kind])
                raise ValueError(
                    f"{where}: the weights in {source.weights_folder} do not fit its config: "
                    f"{len(names)} {kind.replace('_', ' ')} (first {names[0][:100]!r})"
                )
    model = model.float()  # a config that names another dtype: the run trains fp32 parameters
    model.train()  # from_pretrained gives eval mode; the worker's loop trains
    return model
