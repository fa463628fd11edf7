"""The model's architectural hyperparameters as plain JSON data (`model_config_of`): what a model's
parameter shapes cannot show (a model with another n_head has the same shapes but computes another function),
recorded in the fragment layout (common/fragments.py) and compared through the model fingerprint
(common/fingerprint.py).

Pure: it reads `model.config` and imports neither torch nor the layout or the fingerprint.
"""

from __future__ import annotations

import dataclasses
import math

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
