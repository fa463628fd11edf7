"""The model fingerprint: what a worker and a shard must agree on before they exchange fragments.

Parameter names, shapes and dtypes, the fragment layout, the codecs, H and P; and what shapes cannot show:
the run's seed and the model's architectural hyperparameters (`model_config`: a model with another n_head
has the same shapes but computes another function). Every value is plain JSON data, so that a shard can
hold a fingerprint without the model's code. `fingerprint_diff` names the first difference in words a user
can act on.

A fingerprint that comes off the network (a Join, an upload, a Fetch that describes the run) or out of a
file is read here and nowhere else: `parse_fingerprint` takes its text (bounded, a JSON object), and
`layout_from_fingerprint` the layout it lists, strictly (a whitelist of dtypes, a bounded number and size of
dimensions and of values), before anything is allocated for it. Both raise a one-line ValueError.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import TYPE_CHECKING

from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fragments import Fragment, FragmentLayout, ParamEntry
from streamdiloco.common.logs import escaped
from streamdiloco.common.modelconfig import model_config_of  # noqa: F401 (re-exported: the fingerprint's part)

if TYPE_CHECKING:
    import torch


MAX_FINGERPRINT_BYTES = 4 << 20  # a fingerprint lists parameter names and shapes: kilobytes, not megabytes
MAX_DIMS = 16  # dimensions of one parameter
MAX_VALUES = 1 << 40  # values in one parameter or the whole model: a bound on what a fingerprint may claim
# the dtypes a parameter may have (torch's names, as build_layout writes them): floats, which the fp32
# vectors on the wire hold
FLOAT_DTYPES = frozenset(
    {
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
    }
)


def parse_fingerprint(text: str | bytes, where: str = "model fingerprint") -> dict:
    """A fingerprint's JSON text, read: a JSON object of at most MAX_FINGERPRINT_BYTES characters; a
    ValueError (one line, starting with `where`) otherwise. Its fields are checked by the readers of what
    they list (layout_from_fingerprint) or by comparison with a known fingerprint (fingerprint_diff)."""
    if len(text) > MAX_FINGERPRINT_BYTES:
        raise ValueError(
            f"{where} of {len(text):,} characters is too large (at most {MAX_FINGERPRINT_BYTES:,})"
        )
    try:
        fp = json.loads(text)
    except (ValueError, RecursionError) as e:  # RecursionError: JSON nested too deeply
        raise ValueError(f"{where} is not valid JSON: {_short(str(e), quote=False, limit=200)}") from None
    if not isinstance(fp, dict):
        raise ValueError(f"{where} is not valid JSON: not a JSON object")
    return fp


def read_params(fp: object, where: str = "the fingerprint") -> list[tuple[str, tuple[int, ...], str]]:
    """A fingerprint's parameters as (name, shape, dtype), in its order, checked: each listed once, a
    float dtype of FLOAT_DTYPES, at most MAX_DIMS dimensions, each size and the total at most MAX_VALUES.
    ValueError (one line, starting with `where`) for one that is not a fingerprint's shape."""
    if not isinstance(fp, dict):
        raise ValueError(f"{where} is not a model fingerprint (a JSON object)")
    params, fragments = fp.get("params"), fp.get("fragments")
    if not isinstance(params, list) or not isinstance(fragments, list) or not fragments:
        raise ValueError(f"{where} lacks its lists of parameters and fragments")
    out, seen, total = [], set(), 0
    for p in params:
        ok = isinstance(p, list) and len(p) == 3 and isinstance(p[0], str) and isinstance(p[2], str)
        shape = p[1] if ok else None
        if not ok or not isinstance(shape, list) or len(shape) > MAX_DIMS:
            raise ValueError(f"{where} lists a parameter that is not [name, shape, dtype]: {str(p)[:80]}")
        name = p[0]
        if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_VALUES for d in shape):
            raise ValueError(f"{where} gives parameter {name[:80]!r} the shape {str(shape)[:80]}")
        if p[2] not in FLOAT_DTYPES:
            raise ValueError(
                f"{where} gives parameter {name[:80]!r} the dtype {p[2][:40]!r}, not a float dtype"
            )
        if name in seen:
            raise ValueError(f"{where} lists parameter {name[:80]!r} twice")
        seen.add(name)
        total += math.prod(shape)
        if total > MAX_VALUES:
            raise ValueError(f"{where} claims more than {MAX_VALUES:,} values")
        out.append((name, tuple(shape), p[2]))
    return out


def layout_from_fingerprint(
    fp: object, where: str = "the fingerprint", pattern: str | None = None
) -> FragmentLayout:
    """The run's fragment layout (names, shapes, dtypes, offsets, each fragment's blocks) from its model
    fingerprint alone, exactly as it lists them: how a shard with no model takes the first worker's layout,
    and export the run's. `pattern`: the layout's fragment pattern (None: the fingerprint's own). ValueError
    (one line, starting with `where`) for a fingerprint that is not one: it may come off the network."""
    by_name = {name: (shape, dtype) for name, shape, dtype in read_params(fp, where)}
    assert isinstance(fp, dict)  # read_params checked it
    out, listed = [], []
    for i, f in enumerate(fp["fragments"]):
        if not (
            isinstance(f, list)
            and len(f) == 2
            and isinstance(f[0], list)
            and all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b <= MAX_VALUES for b in f[0])
            and isinstance(f[1], list)
            and all(isinstance(n, str) for n in f[1])
        ):
            raise ValueError(f"{where}: fragment {i} is not [blocks, names]")
        entries, off = [], 0
        for name in f[1]:
            if name not in by_name:
                raise ValueError(f"{where}: fragment {i} names {name[:80]!r}, which is not a parameter")
            shape, dtype = by_name[name]
            entries.append(ParamEntry(name, shape, off, math.prod(shape), dtype))
            off += math.prod(shape)
        listed += f[1]
        out.append(Fragment(i, tuple(entries), tuple(f[0])))
    if listed != list(by_name):  # model_fingerprint lists the parameters fragment by fragment, each once
        raise ValueError(
            f"{where}: its fragments do not hold every parameter once (listed in order, each once)"
        )
    blocks_path = fp.get("blocks_path", "")
    if pattern is None:
        pattern = fp.get("fragment_pattern", "strided")
    if not isinstance(blocks_path, str) or not isinstance(pattern, str):
        raise ValueError(f"{where}: blocks_path and fragment_pattern must be strings")
    return FragmentLayout(tuple(out), blocks_path, pattern)


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
    if cfg.outer_variant != "nesterov":  # likewise: the shards step so, and the workers' pushes carry its
        fp["outer_variant"] = cfg.outer_variant  # error feedback (SparseLoCo's momentum)
    if cfg.uplink_decay:  # likewise (the uplink's error feedback): every worker of a run pushes alike
        fp["uplink_feedback"] = float(cfg.uplink_decay)
    return fp


def fingerprint_digest(fp: dict) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]


def fingerprint_diff(ours: dict, theirs: dict, us: str = "worker", them: str = "server") -> str | None:
    """None when equal, else one sentence naming the first difference. A `theirs` without a model_config
    (a shard started from a plain state_dict file knows none) does not check ours. One side's names and
    values may come off the network: the sentence has their control characters escaped (common/logs.py's
    `escaped`), so that it cannot forge a line of the log it goes into."""
    diff = _diff(ours, theirs, us, them)
    return None if diff is None else escaped(diff)


def _diff(ours: dict, theirs: dict, us: str, them: str) -> str | None:
    if "model_config" not in theirs:
        ours = {k: v for k, v in ours.items() if k != "model_config"}
    if ours == theirs:
        return None
    for check in (_groups_diff, _settings_diff, _params_diff, _model_config_diff, _other_diff):
        if (what := check(ours, theirs, us, them)) is not None:
            return f"model fingerprint differs from the {them}'s: {what}"
    return (
        f"model fingerprint differs from the {them}'s: the parameters are grouped into fragments differently"
    )


# The settings a fingerprint carries, compared in this order (the first that differs is named)
_SETTINGS = (
    "sync_every",
    "num_fragments",
    "fragment_pattern",
    "uplink_codec",
    "downlink_codec",
    "codec_block_size",
    "blocks_path",
    "sync_schedule",
    "max_steps_per_tick",
    "outer_variant",
    "uplink_feedback",
)


def _groups_diff(ours: dict, theirs: dict, us: str, them: str) -> str | None:
    if ours.get("fragment_groups") == theirs.get("fragment_groups"):
        return None
    return (
        f"the {us} {_grouping(ours)}, the {them} {_grouping(theirs)}: give both the same fragments "
        "(connect(fragments=...), --fragments)"
    )


def _settings_diff(ours: dict, theirs: dict, us: str, them: str) -> str | None:
    for key in _SETTINGS:
        if key == "sync_schedule" and ours.get(key, "fixed") != theirs.get(key, "fixed"):
            mine, other = ours.get(key, "fixed"), theirs.get(key, "fixed")
            return f"sync_schedule is {mine!r} on the {us}, {other!r} on the {them}"
        if key == "outer_variant":  # absent: nesterov
            mine, other = ours.get(key, "nesterov"), theirs.get(key, "nesterov")
            if mine != other:
                return f"outer_variant is {mine!r} on the {us}, {other!r} on the {them} (--outer-variant)"
            continue
        if key == "uplink_feedback":  # absent: 0.0, off
            mine, other = ours.get(key, 0.0), theirs.get(key, 0.0)
            if mine != other:
                return f"uplink_feedback is {mine!r} on the {us}, {other!r} on the {them}"
            continue
        if ours.get(key) != theirs.get(key):
            return f"{key} is {ours.get(key)!r} on the {us}, {theirs.get(key)!r} on the {them}"
    if ours.get("seed") != theirs.get("seed"):
        return f"seed is {_short(ours.get('seed'))} on the {us}, {_short(theirs.get('seed'))} on the {them}"
    return None


def _params_diff(ours: dict, theirs: dict, us: str, them: str) -> str | None:
    a = {p[0]: p for p in ours.get("params", [])}
    b = {p[0]: p for p in theirs.get("params", [])}
    nblocks_a = sum(len(f[0]) for f in ours.get("fragments", []))
    nblocks_b = sum(len(f[0]) for f in theirs.get("fragments", []))
    if nblocks_a != nblocks_b:
        return f"{us} has {nblocks_a} blocks, {them} {nblocks_b}"
    if missing := sorted(set(b) - set(a)):
        return f"the {us} lacks parameter {missing[0]!r} ({len(missing)} missing)"
    if extra := sorted(set(a) - set(b)):
        return f"the {us} has extra parameter {extra[0]!r} ({len(extra)} extra)"
    for name, pa in a.items():
        pb = b[name]
        if pa[1] != pb[1]:
            return f"{name} has shape {pa[1]} on the {us}, {pb[1]} on the {them}"
        if pa[2] != pb[2]:
            return f"{name} has dtype {pa[2]} on the {us}, {pb[2]} on the {them}"
    return None


def _model_config_diff(ours: dict, theirs: dict, us: str, them: str) -> str | None:
    mine, yours = ours.get("model_config"), theirs.get("model_config")
    if mine == yours:
        return None
    if not isinstance(mine, dict) or not isinstance(yours, dict):
        return "model_config is not a table on both sides"
    for key in sorted(set(mine) | set(yours), key=str):
        if mine.get(key, _ABSENT) != yours.get(key, _ABSENT):
            name = _short(key, quote=False)
            a_value, b_value = _short(mine.get(key, _ABSENT)), _short(yours.get(key, _ABSENT))
            return f"model_config.{name} is {a_value} on the {us}, {b_value} on the {them}"
    return None


def _other_diff(ours: dict, theirs: dict, us: str, them: str) -> str | None:
    """Keys a shard learned with a layout (the model's config...) that the checks above do not name."""
    for key in sorted(set(ours) | set(theirs)):
        if key not in ("params", "fragments", "model_config") and ours.get(key) != theirs.get(key):
            mine, other = repr(ours.get(key))[:200], repr(theirs.get(key))[:200]
            return f"{key} is {mine} on the {us}, {other} on the {them}"
    return None


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
