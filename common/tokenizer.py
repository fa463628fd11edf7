"""Tokenizers (the `tokenizers` package, imported only when one is needed): a local one read
(`load_tokenizer`: a tokenizer.json, or a folder saved with save_pretrained, and its end-of-text token), one
trained here (`train_tokenizer`: byte-level BPE with <|endoftext|> as id 0), the ids one holds
(`tokenizer_vocab_size`); and the tokenizer written beside an exported transformers model
(`read_tokenizer`, `ExportTokenizer.write`: tokenizer.json and tokenizer_config.json, so that
AutoTokenizer.from_pretrained loads it).

Nothing is downloaded. It must not import torch (a model is only passed in, to check its vocabulary).
Errors are one line: PreparedDataError where data is being prepared, ValueError for export's --tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamdiloco.common.prepared import PreparedDataError

if TYPE_CHECKING:
    import torch

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")  # a bare tokenizer.json's
TRAINED_EOS = "<|endoftext|>"
INSTALL_HINT = (
    "`streamdiloco data prepare` needs the tokenizers package: pip install 'streamdiloco[data]' "
    "(or pip install tokenizers)"
)


def import_tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise PreparedDataError(INSTALL_HINT) from None
    return tokenizers


def load_tokenizer(path: str, eos: str | None) -> tuple[Any, bytes, int, int | None, str]:
    """A local tokenizer: (Tokenizer, its JSON bytes, the EOS id, the model's vocab_size if the folder has
    a config.json with one, its source). `path` is a tokenizer.json or a folder holding one."""
    tk = import_tokenizers()
    p = Path(path)
    folder = p if p.is_dir() else None
    file = p / "tokenizer.json" if folder else p
    if not file.is_file():
        raise PreparedDataError(
            f"--tokenizer {p}: no tokenizer.json there (give a tokenizer.json or a folder saved with "
            "save_pretrained; slow, sentencepiece-only tokenizers are not read)"
        )
    data = file.read_bytes()
    try:
        tok = tk.Tokenizer.from_str(data.decode("utf-8"))
    except Exception as e:  # tokenizers raises plain Exception for a malformed file
        raise PreparedDataError(f"--tokenizer {file}: not a tokenizers JSON file ({e})") from None
    config = _json_or_empty(folder / "tokenizer_config.json") if folder else {}
    special = _json_or_empty(folder / "special_tokens_map.json") if folder else {}
    named = eos or _token_content(config.get("eos_token")) or _token_content(special.get("eos_token"))
    if named is None:
        named = next((t for t in EOS_CANDIDATES if tok.token_to_id(t) is not None), None)
        if named is None:
            raise PreparedDataError(
                f"--tokenizer {p}: cannot tell its end-of-text token (none of {', '.join(EOS_CANDIDATES)}): "
                "name it with --eos TOKEN"
            )
    eos_id = tok.token_to_id(named)
    if eos_id is None:
        raise PreparedDataError(f"--tokenizer {p}: has no token {named!r} (the EOS asked for)")
    model_vocab = (_json_or_empty(folder / "config.json") if folder else {}).get("vocab_size")
    model_vocab = model_vocab if isinstance(model_vocab, int) and not isinstance(model_vocab, bool) else None
    return tok, data, eos_id, model_vocab, str(p)


def _json_or_empty(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PreparedDataError(f"{path}: not JSON ({e})") from None
    return d if isinstance(d, dict) else {}


def _token_content(t: Any) -> str | None:
    """tokenizer_config.json's eos_token: a string or {"content": ...}."""
    if isinstance(t, dict):
        t = t.get("content")
    return t if isinstance(t, str) and t else None


def train_tokenizer(texts: Iterator[str], vocab: int) -> Any:
    """A byte-level BPE of at most `vocab` ids trained on `texts`, with <|endoftext|> as id 0."""
    tk = import_tokenizers()
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[TRAINED_EOS],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def tokenizer_vocab_size(tok: Any) -> int:
    """One more than the largest id the tokenizer has (added tokens included)."""
    return max(tok.get_vocab(with_added_tokens=True).values()) + 1


# --- the tokenizer, beside an exported model (`streamdiloco export --tokenizer` with --hf-out) -------------
TOKENIZER_CLASS = "PreTrainedTokenizerFast"  # any tokenizers JSON, whatever the model's type


@dataclass(frozen=True)
class ExportTokenizer:
    """--tokenizer, read and checked: its tokenizers JSON as it is, and its end-of-text token (also BOS and
    UNK, as GPT-2's <|endoftext|> is) when known: the prepared data's EOS, else a usual name it has."""

    json_bytes: bytes
    eos: str | None

    def write(self, folder: str | Path, model: torch.nn.Module) -> None:
        """tokenizer.json and a tokenizer_config.json in `folder`, for AutoTokenizer.from_pretrained."""
        from streamdiloco.common.atomic import atomic_write_bytes, atomic_write_text

        config: dict[str, object] = {"tokenizer_class": TOKENIZER_CLASS}
        if self.eos is not None:
            config |= {"bos_token": self.eos, "eos_token": self.eos, "unk_token": self.eos}
        positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        if isinstance(positions, int) and not isinstance(positions, bool):
            config["model_max_length"] = positions
        atomic_write_bytes(Path(folder) / "tokenizer.json", self.json_bytes)
        atomic_write_text(Path(folder) / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")


def read_tokenizer(path: str, model: torch.nn.Module, spec: str) -> ExportTokenizer:
    """--tokenizer PATH: a tokenizer.json, a prepared data folder (its tokenizer, EOS from its manifest) or a
    folder holding a tokenizer.json; ValueError (one line) unless it parses and the model takes every id."""
    from streamdiloco.common.modelspec import check_vocab
    from streamdiloco.common.prepared import PreparedData, looks_prepared

    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError("--tokenizer needs tokenizers: pip install 'streamdiloco[data]'") from None
    where, eos_id = Path(path), None
    if looks_prepared(where):
        try:
            prepared = PreparedData.open(where)
        except PreparedDataError as e:
            raise ValueError(f"--tokenizer {path}: {e}") from None
        file, eos_id = prepared.tokenizer_path, prepared.eos_id
    else:
        file = where / "tokenizer.json" if where.is_dir() else where
    if not file.is_file():
        what = "no tokenizer.json in that folder" if where.is_dir() else "no such file"
        raise ValueError(f"--tokenizer {path}: {what}: give a tokenizer.json or the prepared data folder")
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises plain Exception for a malformed file
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ValueError(f"--tokenizer {file}: not a tokenizers JSON file ({first})") from None
    check_vocab(model, tokenizer_vocab_size(tok), spec, f"the tokenizer {file}")
    if eos_id is not None:
        eos = tok.id_to_token(eos_id)
        if eos is None:
            raise ValueError(f"--tokenizer {path}: the manifest's EOS id {eos_id} is not a token of {file}")
    else:
        eos = next((t for t in EOS_CANDIDATES if tok.token_to_id(t) is not None), None)
    return ExportTokenizer(file.read_bytes(), eos)
