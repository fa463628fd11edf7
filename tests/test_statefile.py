"""A model's layout without its code (common/statefile.py): from a state_dict's names, shapes and dtypes, the
same FragmentLayout as build_layout on the model, for the built-in presets, a transformers-like GPT with
tied weights and nested lists, and a LLaMA-like naming; files read back with their values."""

import json

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fingerprint import model_fingerprint
from streamdiloco.common.fragments import build_layout, flatten, fragment_params
from streamdiloco.common.modelspec import BUILTIN_PRESETS
from streamdiloco.common.statefile import (
    FINGERPRINT_KEY,
    ParamSpec,
    detect_blocks,
    layout_from_description,
    read_init_file,
    state_dict_params,
)
from streamdiloco.worker.model import build_gpt


def describe(model: nn.Module) -> list[ParamSpec]:
    """What a shard sees of a model: its state_dict, less what is not a parameter."""
    state = state_dict_params(model.state_dict(keep_vars=True))
    return [ParamSpec(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in state.items()]


class Attn(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.register_buffer("bias", torch.tril(torch.ones(4, 4)), persistent=False)  # as GPT-2's mask


class MoE(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(n))  # a nested, shorter list


class HFBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = Attn(d)
        self.mlp = MoE(d, 3)


class HFLikeGPT(nn.Module):
    """transformers' GPT2LMHeadModel naming: transformer.{wte,wpe,h.<i>,ln_f}, lm_head tied to wte."""

    def __init__(self, d=8, layers=5):
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(11, d),
                wpe=nn.Embedding(4, d),
                h=nn.ModuleList(HFBlock(d) for _ in range(layers)),
                ln_f=nn.LayerNorm(d),
            )
        )
        self.lm_head = nn.Linear(d, 11, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied: lm_head.weight is the second name
        self.register_buffer("position_ids", torch.arange(4))  # an integer buffer in the state_dict


class LlamaLike(nn.Module):
    """model.embed_tokens, model.layers.<i>.{self_attn,mlp}.*, model.norm, an untied lm_head, in bf16."""

    def __init__(self, d=8, layers=6):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(13, d)
        self.model.layers = nn.ModuleList(
            nn.ModuleDict(dict(self_attn=nn.Linear(d, d, bias=False), mlp=nn.Linear(d, d)))
            for _ in range(layers)
        )
        self.model.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, 13, bias=False)
        self.to(torch.bfloat16)


def models():
    out = []
    for preset in BUILTIN_PRESETS:
        with torch.device("meta"):  # the large presets' shapes without their memory
            out.append(pytest.param(build_gpt(preset), id=preset))
    out.append(pytest.param(HFLikeGPT(), id="hf-gpt2-like"))
    out.append(pytest.param(LlamaLike(), id="llama-like"))
    return out


@pytest.mark.parametrize("pattern", ["strided", "sequential"])
@pytest.mark.parametrize("P", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("model", models())
def test_the_layout_from_the_names_equals_build_layout_on_the_model(model, P, pattern):
    want = build_layout(model, P, pattern)
    got = layout_from_description(describe(model), P, pattern)
    assert got == want
    cfg = SyncConfig(sync_every=P * 6, num_fragments=P, fragment_pattern=pattern)
    # the layout (the model's config is not in a file's names: compared apart, at Join)
    assert model_fingerprint(got, cfg, model_config={}) == model_fingerprint(want, cfg, model_config={})


def test_tied_weights_and_integer_buffers_are_not_parameters_of_the_description():
    names = [p.name for p in describe(HFLikeGPT())]
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names
    assert "position_ids" not in names
    assert [p.name for p in describe(build_gpt("nano"))] == [
        n for n, _ in build_gpt("nano").named_parameters()
    ]


def test_blocks_are_detected_as_the_longest_numbered_list():
    assert detect_blocks(describe(HFLikeGPT(layers=5))) == ("transformer.h", 5)  # not h.<i>.mlp.experts (3)
    assert detect_blocks(describe(HFLikeGPT(layers=2))) == ("transformer.h.0.mlp.experts", 3)
    assert detect_blocks(describe(LlamaLike(layers=6))) == ("model.layers", 6)
    assert detect_blocks([ParamSpec("w", (3,), "float32")]) is None
    # a name given overrides what would be detected; the layout then matches build_layout's with it
    model = HFLikeGPT(layers=2)
    assert layout_from_description(describe(model), 3, blocks_path="transformer.h") == build_layout(
        model, 3, blocks_path="transformer.h"
    )
    with pytest.raises(ValueError, match="blocks_path 'nope' names no blocks"):
        layout_from_description(describe(model), 3, blocks_path="nope")
    with pytest.raises(ValueError, match="no parameter name has the pattern prefix.<int>."):
        layout_from_description([ParamSpec("w", (3,), "float32")], 2)
    with pytest.raises(ValueError, match="3 block fragments need at least as many blocks, the model has 2"):
        layout_from_description(describe(model), 4, blocks_path="transformer.h")


def _flat(model, layout):
    return [flatten(fragment_params(model, f)) for f in layout.fragments]


def test_a_torch_saved_state_dict_reads_back_as_the_models_layout_and_values(tmp_path):
    torch.manual_seed(5)
    model = build_gpt("nano")
    torch.save(model.state_dict(), tmp_path / "model.pt")  # both names of the tied weight, one storage
    init = read_init_file(str(tmp_path / "model.pt"))
    assert init.source == "detected from the names" and init.fingerprint is None
    layout = init.layout(3, "strided")
    assert layout == build_layout(model, 3)
    assert all(torch.equal(a, b) for a, b in zip(init.initial(layout), _flat(model, layout), strict=True))


def test_a_safetensors_file_with_the_runs_fingerprint_gives_its_layout_and_keeps_unknown_keys(tmp_path):
    torch.manual_seed(6)
    model = HFLikeGPT(layers=2)  # detection alone would pick the experts' list: the fingerprint says h
    run = build_layout(model, 3, blocks_path="transformer.h")
    fp = {**model_fingerprint(run, SyncConfig(sync_every=6, num_fragments=3)), "model_config": {"n_head": 2}}
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, tmp_path / "m.safetensors", metadata={FINGERPRINT_KEY: json.dumps(fp)})
    init = read_init_file(str(tmp_path / "m.safetensors"))
    assert init.source == "from the file's fingerprint"
    # another P than the exporting run's: the blocks still come from the fingerprint
    for P in (2, 3):
        layout = init.layout(P, "sequential")
        assert layout == build_layout(model, P, "sequential", blocks_path="transformer.h")
        assert all(torch.equal(a, b) for a, b in zip(init.initial(layout), _flat(model, layout), strict=True))
    assert init.opaque() == {"seed": 0, "model_config": {"n_head": 2}}
    # one fragment needs the order of the blocks among the rest, which a fingerprint of 3 does not keep
    with pytest.raises(ValueError, match="use --num-fragments 2 or more"):
        init.layout(1, "strided")
    one = model_fingerprint(build_layout(model, 1), SyncConfig(sync_every=6, num_fragments=1))
    save_file(state, tmp_path / "one.safetensors", metadata={FINGERPRINT_KEY: json.dumps(one)})
    init = read_init_file(str(tmp_path / "one.safetensors"), blocks_path="transformer.h")
    assert init.source == "from --blocks-path"
    for P in (1, 3):
        assert init.layout(P, "strided") == build_layout(model, P, blocks_path="transformer.h")
    with pytest.raises(ValueError, match="differs from the file's fingerprint's 'transformer.h'"):
        read_init_file(str(tmp_path / "m.safetensors"), blocks_path="transformer.h.0.mlp.experts")


def test_files_that_cannot_start_a_shard_get_one_line_errors(tmp_path):
    model = build_gpt("nano")
    plain = {k: v.contiguous().clone() for k, v in model.state_dict().items()}
    save_file(plain, tmp_path / "plain.safetensors")
    with pytest.raises(ValueError, match="keeps neither the model's parameter order"):
        read_init_file(str(tmp_path / "plain.safetensors"))
    bad = dict(plain)
    bad["transformer.ln_f.weight"] = torch.full_like(bad["transformer.ln_f.weight"], float("nan"))
    torch.save(bad, tmp_path / "nan.pt")
    with pytest.raises(ValueError, match="transformer.ln_f.weight has 32 values that are not finite"):
        read_init_file(str(tmp_path / "nan.pt"))
    with pytest.raises(ValueError, match="no such file"):
        read_init_file(str(tmp_path / "missing.pt"))
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a saved state_dict"):
        read_init_file(str(tmp_path / "junk.pt"))
    torch.save([torch.zeros(1)], tmp_path / "list.pt")
    with pytest.raises(ValueError, match="holds a list, not a state_dict"):
        read_init_file(str(tmp_path / "list.pt"))
    fp = {"params": [["transformer.wte.weight", [9, 9], "float32"]], "fragments": [[[], ["x"]]]}
    save_file(plain, tmp_path / "wrong.safetensors", metadata={FINGERPRINT_KEY: json.dumps(fp)})
    with pytest.raises(ValueError, match=r"transformer.wte.weight has shape \[256, 32\], its fingerprint"):
        read_init_file(str(tmp_path / "wrong.safetensors"))


def test_a_key_the_shard_learned_with_the_layout_is_compared_and_named():
    from streamdiloco.common.fingerprint import fingerprint_diff

    model = build_gpt("nano")
    fp = model_fingerprint(build_layout(model, 3), SyncConfig(sync_every=6, num_fragments=3))
    shard = {**fp, "model_config": {"n_head": 2}}
    assert fingerprint_diff(shard, shard) is None
    assert fingerprint_diff({**fp, "model_config": {"n_head": 4}}, shard, us="worker", them="shard") == (
        "model fingerprint differs from the shard's: model_config.n_head is 4 on the worker, 2 on the shard"
    )
    assert "model_config." in (fingerprint_diff(fp, shard) or "")
    # any other key a shard learned with the layout is compared too, and named
    assert fingerprint_diff(
        {**fp, "tokenizer": "a"}, {**fp, "tokenizer": "b"}, us="worker", them="shard"
    ) == ("model fingerprint differs from the shard's: tokenizer is 'a' on the worker, 'b' on the shard")
