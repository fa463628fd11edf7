"""The model fingerprint: what a worker and a shard must agree on before they exchange fragments.

Parameter names, shapes and dtypes, the fragment layout, the codecs, H and P; and what shapes cannot show:
the run's seed and the model's architectural hyperparameters (`model_config`: a model with another n_head
has the same shapes but computes another function). Every value is plain JSON data, so that a shard can
hold a fingerprint without the model's code. `fingerprint_diff` names the first difference in words a user
can act on.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import TYPE_CHECKING

from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fragments import FragmentLayout

if TYPE_CHECKING:
    import torch


# Keys of a model's config that do not change the function its parameters compute: regularization, outputs
# and caching switches, token ids, bookkeeping (transformers' PretrainedConfig.to_dict() has them all)
NON_ARCHITECTURAL = frozenset(
    """
    architectures bad_words_ids bos_token_id chunk_size_feed_forward decoder_start_token_id
    diversity_penalty do_sample dtype early_stopping eos_token_id exponential_decay_length_penalty
    finetuning_task forced_bos_token_id forced_eos_token_id id2label initializer_range label2id
    length_penalty max_length min_length name_or_path no_repeat_ngram_size num_beam_groups num_beams
    num_return_sequences output_attentions output_hidden_states output_scores pad_token_id prefix
    problem_type pruned_heads remove_invalid_values repetition_penalty return_dict
    return_dict_in_generate sep_token_id suppress_tokens task_specific_params temperature tf_legacy_loss
    tokenizer_class top_k top_p torch_dtype torchscript transformers_version typical_p use_bfloat16
    use_cache
    """.split()
)


def model_config_of(model: object) -> dict:
    """The architectural hyperparameters of `model.config` as plain JSON data: its `to_dict()` (a
    transformers model: n_head, rope parameters, ...) or a dataclass's fields (the built-in GPTConfig), less
    NON_ARCHITECTURAL keys, keys that start with "_" and dropout rates (training noise, not the function),
    and values that are not plain data (numbers, strings, booleans, None, and lists and tables of them).
    {} for a model without a config (a plain nn.Module): its shapes are all the fingerprint can check."""
    import dataclasses

    config = getattr(model, "config", None)
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):  # first: transformers' configs may be dataclasses too, but to_dict() is theirs
        items = to_dict()
    elif dataclasses.is_dataclass(config) and not isinstance(config, type):
        items = dataclasses.asdict(config)
    else:
        return {}
    if not isinstance(items, dict):
        return {}
    out = {}
    for key, value in items.items():
        if (
            not isinstance(key, str)
            or key.startswith("_")
            or key in NON_ARCHITECTURAL
            or "dropout" in key
            or "pdrop" in key
        ):
            continue
        plain = _plain(value)
        if plain is not _NOT_PLAIN:
            out[key] = plain
    return dict(sorted(out.items()))


_NOT_PLAIN = object()


def _plain(value, depth: int = 0):
    """`value` as JSON data (tuples as lists), or _NOT_PLAIN."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else _NOT_PLAIN
    if depth >= 4:
        return _NOT_PLAIN
    if isinstance(value, list | tuple):
        items = [_plain(v, depth + 1) for v in value]
        return _NOT_PLAIN if any(v is _NOT_PLAIN for v in items) else items
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        table = {k: _plain(v, depth + 1) for k, v in value.items()}
        return _NOT_PLAIN if any(v is _NOT_PLAIN for v in table.values()) else table
    return _NOT_PLAIN


def model_fingerprint(
    layout: FragmentLayout, cfg: SyncConfig, seed: int = 0, model_config: dict | None = None
) -> dict:
    """What a worker and a shard must agree on. `seed`: the run's (it seeds the initial values and the
    stochastic rounding); `model_config`: model_config_of(model), by default the one build_layout took."""
    fp = {
        "params": [[e.name, list(e.shape), e.dtype] for f in layout.fragments for e in f.entries],
        "fragments": [[list(f.blocks), list(f.names)] for f in layout.fragments],
        "blocks_path": layout.blocks_path,
        "sync_every": cfg.sync_every,
        "num_fragments": cfg.num_fragments,
        "fragment_pattern": cfg.fragment_pattern,
        "uplink_codec": cfg.uplink_codec,
        "downlink_codec": cfg.downlink_codec,
        "codec_block_size": cfg.codec_block_size,
        "seed": seed,
        "model_config": layout.model_config if model_config is None else model_config,
    }
    if layout.groups is not None:  # only then: a run's fingerprint (and its checkpoints') stays as it was
        fp["fragment_groups"] = [list(g) for g in layout.groups]
    if cfg.sync_schedule != "fixed":  # likewise: the shards stretch their caps for it, so both must agree
        fp["sync_schedule"] = cfg.sync_schedule
        fp["max_steps_per_tick"] = float(cfg.max_steps_per_tick)
    return fp


def fingerprint_digest(fp: dict) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]


def fingerprint_diff(ours: dict, theirs: dict, us: str = "worker", them: str = "server") -> str | None:
    """None when equal, else one sentence naming the first difference. A `theirs` without a model_config
    (a shard started from a plain state_dict file knows none) does not check ours."""
    if "model_config" not in theirs:
        ours = {k: v for k, v in ours.items() if k != "model_config"}
    if ours == theirs:
        return None
    if ours.get("fragment_groups") != theirs.get("fragment_groups"):
        return (
            f"model fingerprint differs from the {them}'s: the {us} {_grouping(ours)}, the {them} "
            f"{_grouping(theirs)}: give both the same fragments (connect(fragments=...), --fragments)"
        )
    for key in (
        "sync_every",
        "num_fragments",
        "fragment_pattern",
        "uplink_codec",
        "downlink_codec",
        "codec_block_size",
        "blocks_path",
        "sync_schedule",
        "max_steps_per_tick",
    ):
        if key == "sync_schedule" and ours.get(key, "fixed") != theirs.get(key, "fixed"):
            mine, other = ours.get(key, "fixed"), theirs.get(key, "fixed")
            return (
                f"model fingerprint differs from the {them}'s: sync_schedule is {mine!r} on the {us}, "
                f"{other!r} on the {them}"
            )
        if ours.get(key) != theirs.get(key):
            return (
                f"model fingerprint differs from the {them}'s: {key} is {ours.get(key)!r} on the {us}, "
                f"{theirs.get(key)!r} on the {them}"
            )
    if ours.get("seed") != theirs.get("seed"):
        return (
            f"model fingerprint differs from the {them}'s: seed is {_short(ours.get('seed'))} on the {us}, "
            f"{_short(theirs.get('seed'))} on the {them}"
        )
    a = {p[0]: p for p in ours.get("params", [])}
    b = {p[0]: p for p in theirs.get("params", [])}
    nblocks_a = sum(len(f[0]) for f in ours.get("fragments", []))
    nblocks_b = sum(len(f[0]) for f in theirs.get("fragments", []))
    if nblocks_a != nblocks_b:
        return f"model fingerprint differs from the {them}'s: {us} has {nblocks_a} blocks, {them} {nblocks_b}"
    if missing := sorted(set(b) - set(a)):
        return (
            f"model fingerprint differs from the {them}'s: the {us} lacks parameter {missing[0]!r} "
            f"({len(missing)} missing)"
        )
    if extra := sorted(set(a) - set(b)):
        return (
            f"model fingerprint differs from the {them}'s: the {us} has extra parameter {extra[0]!r} "
            f"({len(extra)} extra)"
        )
    for name, pa in a.items():
        pb = b[name]
        if pa[1] != pb[1]:
            return (
                f"model fingerprint differs from the {them}'s: {name} has shape {pa[1]} on the {us}, "
                f"{pb[1]} on the {them}"
            )
        if pa[2] != pb[2]:
            return (
                f"model fingerprint differs from the {them}'s: {name} has dtype {pa[2]} on the {us}, "
                f"{pb[2]} on the {them}"
            )
    mine, yours = ours.get("model_config"), theirs.get("model_config")
    if mine != yours:
        if not isinstance(mine, dict) or not isinstance(yours, dict):
            return f"model fingerprint differs from the {them}'s: model_config is not a table on both sides"
        for key in sorted(set(mine) | set(yours), key=str):
            if mine.get(key, _ABSENT) != yours.get(key, _ABSENT):
                name = _short(key, quote=False)
                a_value, b_value = _short(mine.get(key, _ABSENT)), _short(yours.get(key, _ABSENT))
                return (
                    f"model fingerprint differs from the {them}'s: model_config.{name} is {a_value} on the "
                    f"{us}, {b_value} on the {them}"
                )
    for key in sorted(set(ours) | set(theirs)):  # keys a shard learned with a layout (the model's config...)
        if key not in ("params", "fragments", "model_config") and ours.get(key) != theirs.get(key):
            mine_, theirs_ = repr(ours.get(key))[:200], repr(theirs.get(key))[:200]
            return (
                f"model fingerprint differs from the {them}'s: {key} is {mine_} on the {us}, "
                f"{theirs_} on the {them}"
            )
    return (
        f"model fingerprint differs from the {them}'s: the parameters are grouped into fragments differently"
    )


def _grouping(fp: dict) -> str:
    groups = fp.get("fragment_groups")
    if groups is not None:
        return f"groups parameters as {';'.join(','.join(map(str, g)) for g in groups)[:300]!r}"
    return f"splits the blocks of {fp.get('blocks_path')!r}"


class _Absent:
    def __repr__(self) -> str:
        return "absent"


_ABSENT = _Absent()


def _short(value, quote: bool = True, limit: int = 60) -> str:
    """A value as it goes into an error message, cut to `limit` characters (a worker's fingerprint comes
    off the network)."""
    text = repr(value) if quote else str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def tensor_digest(x: torch.Tensor) -> str:
    """A short hash of a tensor's fp32 bytes: shards publish it for each master slice, workers log it for
    each mirror slice, and equal hashes mean bit-equal parameters."""
    data = x.detach().to(device="cpu").contiguous().float().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]
