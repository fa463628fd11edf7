"""One config, one source of truth (cli/settings.py): every field of every config dataclass is a flag and a
key of the config file, a value comes from the command line, else the file, else the default, bad files
stop with one line naming the file, section and key, and launch hands its children OUT/run.toml."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from streamdiloco.cli import LAUNCH_SECTIONS, build_parser, main
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fingerprint import fingerprint_diff, model_config_of, model_fingerprint
from streamdiloco.common.fragments import build_layout
from streamdiloco.settings import _default, _kind, dump_toml, read_config, resolve, section_classes, tomllib
from streamdiloco.worker.model import build_gpt
from tests.support.procs import ROOT, Cluster, http_json, streamdiloco

COMMANDS = {  # each command and the config file's sections it reads
    "server": ("model", "sync", "server", "robust", "limits", "link", "pieces"),
    "worker": ("model", "run", "sync", "inner", "link", "worker", "pieces"),
    "launch": LAUNCH_SECTIONS,
    "simulate": ("model", "run", "sync", "inner", "robust"),
    "compare": ("model", "run", "sync", "inner", "robust"),
    "config": LAUNCH_SECTIONS,
}
REQUIRED = {"worker": ["--servers", "127.0.0.1:1"]}


def _subparser(command: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _options(command: str) -> set[str]:
    return {o for a in _subparser(command)._actions for o in a.option_strings}


def _candidates(f: dataclasses.Field, kind: type, default) -> list:
    """Values other than the default that a flag of this field (bool, int, float or str) could take."""
    if f.metadata.get("choices"):
        return [c for c in f.metadata["choices"] if c != default]
    if kind is bool:
        return [not default]
    if kind is int:
        return [default * 2 or 1, default + 1, 1] if default is not None else [48, 1]
    if kind is float:
        return [default / 2 or 0.5, default * 2, 0.5] if default is not None else [0.5, 0.25]
    return ["nano", "int8", "stochastic", "cuda", "elsewhere.txt", "0f" * 32]  # the last: a sha256


def check_flags(cls: type, command: str, section: str) -> None:
    """Every field of `cls` has its flag on `command`, and a value given there reaches the section's
    dataclass as built from the resolved settings (AssertionError naming the field otherwise)."""
    options = _options(command)
    parser = build_parser()
    for f in dataclasses.fields(cls):
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        assert flag in options, f"{cls.__name__}.{f.name}: `streamdiloco {command}` has no {flag}"
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        built = None
        for value in _candidates(f, _kind(cls, f)[0], default):
            if isinstance(value, bool):
                argv = [flag if value else "--no-" + flag.removeprefix("--")]
            else:
                argv = [flag, str(value)]
            args = parser.parse_args([command, *REQUIRED.get(command, []), *argv])
            settings = resolve(args, args.sections)
            assert settings.given[section] == {f.name}, (f.name, settings.given[section])
            try:
                built = settings.build(section)
            except ValueError:
                continue  # not a valid value for this field: try the next
            assert getattr(built, f.name) == value, f"{flag} {value} did not reach {cls.__name__}.{f.name}"
            break
        assert built is not None, f"no value of {flag} that {cls.__name__} takes"


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_field_of_every_section_is_a_flag_that_reaches_its_dataclass(command):
    classes = section_classes()
    assert _subparser(command).get_default("sections") == COMMANDS[command]
    for section in COMMANDS[command]:
        check_flags(classes[section], command, section)


def test_a_renamed_field_whose_flag_stayed_behind_fails_the_check():
    """A copy of SyncConfig with sync_every renamed: the parser (built from the real one) has no flag for
    it, so the check that every field has a flag fails, naming it."""
    renamed = dataclasses.make_dataclass(
        "SyncConfig",
        [
            (
                "sync_interval" if f.name == "sync_every" else f.name,
                f.type,
                dataclasses.field(
                    default=f.default, metadata=f.metadata
                ),  # a new Field: make_dataclass names it
            )
            for f in dataclasses.fields(SyncConfig)
        ],
        frozen=True,
    )
    with pytest.raises(AssertionError, match="SyncConfig.sync_interval: `streamdiloco worker` has no"):
        check_flags(renamed, "worker", "sync")


def test_the_flags_users_know_keep_their_names():
    """Renaming a field renames its flag: these, which READMEs and scripts use, must stay (a field renamed
    on purpose keeps its flag with metadata {"flag": ...})."""
    sync = (
        "--sync-every --num-fragments --fragment-pattern --fragment-sync-delay --merge-policy --merge-rule "
        "--fragment-update-alpha --uplink-codec --downlink-codec --codec-block-size --uplink-rounding "
        "--downlink-rounding --outer-lr --outer-momentum --final-sync --no-final-sync"
    ).split()
    inner = "--lr --warmup-steps --min-lr-ratio --weight-decay --grad-clip".split()
    run = "--steps --batch-size --data --eval-batches --device --model --block-size --seed".split()
    shard = "--min-workers --round-timeout --chunk-bytes --aggregator --clip-norm --max-sessions".split()
    worker = "--log-every --checkpoint-every --join-timeout --reconnect-timeout --step-delay".split()
    for command, flags in {
        "worker": sync + inner + run + worker,
        "simulate": sync + inner + run,
        "launch": sync + inner + run + shard + ["--log-every"],
        "server": sync + shard + ["--model", "--seed", "--block-size"],
    }.items():
        missing = set(flags) - _options(command)
        assert not missing, f"`streamdiloco {command}` lost {sorted(missing)}"


def test_the_codec_and_rounding_flags_list_their_choices_from_the_registry():
    from streamdiloco.common.codecspec import CODECS, ROUNDINGS

    text = " ".join(_subparser("worker").format_help().split())
    roundings = "{" + ",".join(ROUNDINGS) + "}"
    for flag in ("--uplink-codec", "--downlink-codec"):  # any registry name, or a top-k family member
        assert f"{flag} CODEC" in text and ", ".join(CODECS) + ", or topkK_C" in text, flag
    for flag in ("--uplink-rounding", "--downlink-rounding"):
        assert f"{flag} {roundings}" in text, flag
    # a value not in the list is the dataclass's one-line error, not argparse's usage
    args = build_parser().parse_args(["config", "--uplink-codec", "fp4"])
    with pytest.raises(ValueError, match="unknown uplink_codec 'fp4': choose one of " + ", ".join(CODECS)):
        resolve(args, args.sections).build("sync")


def test_help_shows_each_setting_with_its_default():
    text = _subparser("worker").format_help()
    assert "(default 30)" in text and "--no-final-sync" in text and "[sync]" in text


def test_the_fragment_pattern_help_says_what_build_layout_does():
    """strided: block i goes to block fragment i mod (P-1) (the last fragment is the rest of the model)."""
    help_text = " ".join(_subparser("worker").format_help().split())
    assert "block i goes to block fragment i mod (P-1)" in help_text
    model = build_gpt("nano")  # 4 blocks
    layout = build_layout(model, 3, "strided")
    for i in range(4):
        block = {n for n, _ in model.named_parameters() if n.startswith(f"blocks.{i}.")}
        assert block <= set(layout.fragments[i % (3 - 1)].names), i


def test_a_process_config_is_composed_of_the_sections_and_declares_none_of_their_fields():
    """WorkerConfig and SimConfig hold the sections (one declaration per setting, no mirror to keep equal):
    none of their own fields is a section's field, and each section is there whole, with its defaults."""
    from streamdiloco.common.config import compose, section_of
    from streamdiloco.sim.simulator import SimConfig
    from streamdiloco.worker.run import WorkerConfig

    classes = section_classes()
    for cls, sections in (
        (WorkerConfig, ("model", "run", "sync", "inner", "link", "worker", "pieces")),
        (SimConfig, ("model", "run", "sync", "inner", "robust")),
    ):
        # the settings of the sections it holds (the simulator's own --eval-every, default 100, is not
        # [worker]'s: simulate reads no [worker] section)
        settings = {f.name for s in sections for f in dataclasses.fields(classes[s])}
        own = {f.name for f in dataclasses.fields(cls) if section_of(f) is None}
        assert not own & settings, (cls.__name__, own & settings)
        held = {f.name: section_of(f) for f in dataclasses.fields(cls) if section_of(f) is not None}
        assert held == {s: classes[s] for s in sections}, cls.__name__
    # flat names, as flags and keys name them, land in their sections
    cfg = compose(SimConfig, {"model": "nano", "steps": 6, "sync_every": 15, "workers": 3, "weight_cap": 0.0})
    assert (cfg.model.model, cfg.run.steps, cfg.sync.sync_every, cfg.workers) == ("nano", 6, 15, 3)
    assert cfg.robust.weight_cap == 0.0 and cfg.run.batch_size == 16
    base = SyncConfig(num_fragments=3, sync_every=6)
    cfg = compose(SimConfig, {"sync": base, "fragment_sync_delay": 0})
    assert cfg.sync == SyncConfig(num_fragments=3, sync_every=6, fragment_sync_delay=0)
    with pytest.raises(TypeError, match="SimConfig has no setting stepz"):
        compose(SimConfig, {"stepz": 6})


def test_no_two_sections_share_a_field_name():
    """The sections' flags live side by side on one parser: one dest each."""
    names = [f.name for cls in section_classes().values() for f in dataclasses.fields(cls)]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def _write(tmp_path: Path, text: str, name: str = "run.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_command_line_over_config_file_over_default(tmp_path):
    path = _write(
        tmp_path,
        "[sync]\nsync_every = 12\nnum_fragments = 3\nfinal_sync = false\n"
        "[inner]\nlr = 1\n"  # an integer where a float is asked for: taken as 1.0
        "[model]\nmodel = 'nano'\n",
    )
    args = build_parser().parse_args(
        ["worker", "--servers", "127.0.0.1:1", "--config", str(path), "--sync-every", "6"]
    )
    settings = resolve(args, args.sections, args.config)
    sync = settings.build("sync")
    assert (sync.sync_every, sync.num_fragments, sync.final_sync) == (6, 3, False)  # flag, file, file
    assert sync.fragment_sync_delay == SyncConfig().fragment_sync_delay  # default
    assert settings.build("inner").lr == 1.0 and isinstance(settings.values["inner"]["lr"], float)
    assert args.model == "nano" and args.sync_every == 6  # on the namespace, for the commands
    # what the user set, on the command line or in the file: the noinit part's sync_set
    assert args.sync_set == frozenset({"sync_every", "num_fragments", "final_sync"})
    plain = build_parser().parse_args(["worker", "--servers", "127.0.0.1:1", "--no-final-sync"])
    assert resolve(plain, plain.sections).given["sync"] == {"final_sync"}


@pytest.mark.parametrize(
    "text, expect",
    [
        ("[sync]\nsync_evry = 6\n", "[sync] has no key 'sync_evry' (did you mean 'sync_every'?)"),
        # a key in another section than its own (the shard's liveness moved to [link], shared with workers)
        ("[limits]\nliveness_timeout = 20\n", "has no key 'liveness_timeout' (it belongs under [link]"),
        ("[synk]\nsync_every = 6\n", "unknown section [synk] (did you mean 'sync'?); the sections are model"),
        ("[sync]\nsync_every = '6'\n", '[sync] sync_every must be an integer, got "6"'),
        ("[sync]\nsync_every = 6.5\n", "[sync] sync_every must be an integer, got 6.5"),
        ("[sync]\nfinal_sync = 0\n", "[sync] final_sync must be true or false, got 0"),
        ("[run]\ndata = 3\n", "[run] data must be a string (leave it out for the default), got 3"),
        ("[inner]\nlr = true\n", "[inner] lr must be a number, got true"),
        ("sync_every = 6\n", "sync_every = ... is in no section: put it under [sync]"),
        ("[sync\nsync_every = 6\n", "not valid TOML"),
        ("[sync]\nsync_every = 7\n", "use H=5 or H=10"),  # the dataclass's own check, as for the flag
    ],
)
def test_a_bad_config_file_is_one_line_naming_file_section_and_key(tmp_path, capsys, text, expect):
    path = _write(tmp_path, text)
    assert main(["simulate", "--config", str(path), "--model", "nano", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("streamdiloco: error: ") and expect in err[0], err
    if "use H=" not in expect:
        assert str(path) in err[0]


def test_a_missing_config_file(tmp_path, capsys):
    assert main(["config", "--config", str(tmp_path / "nope.toml")]) == 2
    assert f"--config {tmp_path / 'nope.toml'}: no such file" in capsys.readouterr().err


def test_config_writes_a_complete_file_that_reads_back_the_same(tmp_path, capsys):
    out = tmp_path / "mine.toml"
    assert (
        main(["config", "--out", str(out), "--sync-every", "60", "--no-final-sync", "--model", "nano"]) == 0
    )
    text = out.read_text()
    assert "# H, inner steps between two syncs of the same fragment" in text  # the help, as comments
    assert "# block_size =" in text  # a setting with no value: the preset's, shown commented out
    back = read_config(out)
    assert set(back) == set(LAUNCH_SECTIONS)
    assert back["sync"]["sync_every"] == 60 and back["sync"]["final_sync"] is False
    valued = {  # every field but those with no value (None by default)
        s: {f.name for f in dataclasses.fields(c) if _default(f) is not None}
        for s, c in section_classes().items()
    }
    for section, keys in back.items():
        assert keys.keys() == valued[section], section
    # and the same file drives another command to the same settings
    args = build_parser().parse_args(["simulate", "--config", str(out)])
    assert resolve(args, args.sections, args.config).build("sync") == SyncConfig(
        sync_every=60, final_sync=False
    )


def test_dump_toml_round_trips_awkward_values(tmp_path):
    values = {"run": {"data": 'a "quoted"\\path\n', "device": "cpu"}, "inner": {"lr": 1e-05}}
    path = _write(tmp_path, dump_toml(values))
    assert read_config(path) == values


def test_the_example_config_is_complete_and_valid():
    example = ROOT / "examples" / "run.toml"
    back = read_config(example)
    assert set(back) == set(LAUNCH_SECTIONS)
    args = build_parser().parse_args(["launch", "--config", str(example)])
    settings = resolve(args, args.sections, args.config)
    for section in settings.values:
        settings.build(section)


def test_the_example_config_is_what_streamdiloco_config_prints(capsys):
    """examples/run.toml cannot go stale: it is `streamdiloco config`'s output for the flags its own header
    names (make it again with those flags and --out examples/run.toml)."""
    import re
    import shlex

    text = (ROOT / "examples" / "run.toml").read_text()
    made_with = re.search(r"^# Made with `streamdiloco config(.*)`\.$", text, re.M)
    assert made_with, "examples/run.toml has lost its `Made with` line"
    argv = shlex.split(made_with.group(1))
    assert main(["config", *argv]) == 0
    assert capsys.readouterr().out == text, (
        f"examples/run.toml is stale: make it again with `streamdiloco config {shlex.join(argv)} "
        "--out examples/run.toml`"
    )


def test_config_names_the_flags_that_make_it_again(tmp_path, capsys):
    path = _write(tmp_path, "[sync]\nfinal_sync = false\n[run]\ndata = 'my file.txt'\n")
    assert main(["config", "--config", str(path), "--seed", "3", "--steps", "9"]) == 0
    out = capsys.readouterr().out
    line = "# Made with `streamdiloco config --seed 3 --steps 9 --data 'my file.txt' --no-final-sync`."
    assert line in out.splitlines()
    assert main(["config", "--seed", "3", "--steps", "9", "--data", "my file.txt", "--no-final-sync"]) == 0
    assert capsys.readouterr().out == out


def test_launch_print_config_has_what_launch_decides(capsys):
    assert main(["launch", "--print-config", "--workers", "3", "--model", "nano", "--batch-size", "4"]) == 0
    data = tomllib.loads(capsys.readouterr().out)
    assert data["server"]["min_workers"] == 3  # every worker, unless set
    assert data["robust"]["max_weight"] == 4 * 32 * 30  # batch x nano's context x H
    assert data["limits"]["max_sessions_per_peer"] == 8


# --- the fingerprint: the seed and what shapes cannot show ---


def test_model_config_of_the_builtin_gpt_a_transformers_style_config_and_a_plain_module():
    import torch

    assert model_config_of(build_gpt("nano")) == {
        "bias": False,
        "block_size": 32,
        "n_embd": 32,
        "n_head": 2,
        "n_layer": 4,
        "vocab_size": 256,
    }  # dropout is training noise, not architecture

    class HFConfig:  # what transformers' PretrainedConfig.to_dict() looks like
        def to_dict(self):
            return {
                "n_head": 12,
                "n_embd": 768,
                "layer_norm_epsilon": 1e-5,
                "activation_function": "gelu_new",
                "attn_pdrop": 0.1,
                "architectures": ["GPT2LMHeadModel"],
                "transformers_version": "5.0.0",
                "use_cache": True,
                "_name_or_path": "gpt2",
                "id2label": {"0": "LABEL_0"},
                "layer_types": ("full", "full"),
                "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
                "quantization": {"method": object()},  # not plain data: left out
            }

    class HF(torch.nn.Module):
        config = HFConfig()

    assert model_config_of(HF()) == {
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "layer_types": ["full", "full"],
        "n_embd": 768,
        "n_head": 12,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    }
    assert model_config_of(torch.nn.Linear(2, 2)) == {}


def test_model_config_of_a_transformers_gpt2_keeps_heads_and_drops_dropout():
    transformers = pytest.importorskip("transformers")

    class Model:
        config = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64)

    got = model_config_of(Model())
    assert got["n_head"] == 4 and got["n_layer"] == 2 and got["model_type"] == "gpt2"
    assert not any("pdrop" in k or "dropout" in k for k in got) and "transformers_version" not in got
    json.dumps(got, allow_nan=False)  # plain data: it crosses the wire in the fingerprint


def test_fingerprint_diff_names_the_seed_and_the_model_config_key():
    cfg = SyncConfig(sync_every=6, num_fragments=3)
    base = model_fingerprint(build_layout(build_gpt("nano"), 3), cfg)
    heads = model_fingerprint(build_layout(build_gpt("nano", n_head=4), 3), cfg)  # the same shapes
    assert heads["params"] == base["params"]
    assert "model_config.n_head is 4 on the worker, 2 on the shard" in fingerprint_diff(
        heads, base, them="shard"
    )
    seeded = model_fingerprint(build_layout(build_gpt("nano"), 3), cfg, seed=1)
    assert "seed is 1 on the worker, 0 on the shard" in fingerprint_diff(seeded, base, them="shard")
    extra = {**base, "model_config": {**base["model_config"], "rope_theta": 1e4}}
    assert "model_config.rope_theta is 10000.0 on the worker, absent on the shard" in fingerprint_diff(
        extra, base, them="shard"
    )
    long = {**base, "model_config": {**base["model_config"], "x" * 500: "y" * 500}}
    assert len(fingerprint_diff(long, base)) < 300  # a worker's text is cut before it is echoed


# --- real processes ---


# in `make test-slow`; covered by test_command_line_over_config_file_over_default (the file's settings
# reach the dataclasses), test_noinit.py::test_a_worker_takes_the_settings_it_did_not_set_from_the_shard
# (real processes agree on the run's settings) and test_fingerprint_diff_names_the_seed_and_the_model_...
@pytest.mark.slow
def test_a_config_file_drives_a_real_shard_and_worker_and_a_different_seed_or_n_head_is_refused(tmp_path):
    path = _write(
        tmp_path,
        "[model]\nmodel = 'nano'\n[run]\nsteps = 12\nbatch_size = 2\neval_batches = 1\n"
        "[sync]\nsync_every = 6\nnum_fragments = 3\n[server]\nmin_workers = 1\nround_timeout = 30\n",
    )
    # a model with other heads but the same shapes, from a module on the workers' path
    (tmp_path / "other_heads.py").write_text(
        "from streamdiloco.worker.model import build_gpt\n\n\n"
        "def nano_4_heads():\n    return build_gpt('nano', n_head=4)\n"
    )
    with Cluster(tmp_path, env={"PYTHONPATH": str(tmp_path)}) as c:
        target, http = c.shard("shard", "--config", str(path))
        status = http_json(http)
        assert status["config"]["sync_every"] == 6 and status["config"]["num_fragments"] == 3
        assert status["round_timeout"] == 30
        c.worker("w", [target], "--config", str(path))
        assert c.wait("w") == 0, c.log("w")[-3000:]
        summary = c.summary("w")
        assert summary["steps"] == 12 and summary["tokens"] == 12 * 2 * 32  # [run], nano's context
        assert http_json(http)["rounds_closed"] >= 3
        # the same file with another seed on the command line: refused, naming the seed
        c.worker("seeded", [target], "--config", str(path), "--seed", "1", "--join-timeout", "30")
        assert c.wait("seeded") != 0
        assert "seed is 1 on the worker, 0 on the shard" in c.log("seeded"), c.log("seeded")[-3000:]
        c.worker("heads", [target], "--config", str(path), "--model", "other_heads:nano_4_heads")
        assert c.wait("heads") != 0
        assert "model_config.n_head is 4 on the worker, 2 on the shard" in c.log("heads"), c.log("heads")[
            -3000:
        ]


# in `make test-slow`; covered by test_launch_print_config_has_what_launch_decides (what launch writes) and
# test_a_config_file_drives_a_real_shard_and_worker_... (a config file through real processes)
@pytest.mark.slow
def test_launch_hands_its_children_run_toml(tmp_path):
    user = _write(tmp_path, "[sync]\nsync_every = 6\nnum_fragments = 3\n[run]\nsteps = 6\n", "user.toml")
    out = tmp_path / "run"
    r = streamdiloco(
        "launch",
        *("--config", str(user), "--shards", "1", "--workers", "2", "--out", str(out)),
        *("--model", "nano", "--batch-size", "2", "--eval-batches", "1", "--uplink-codec", "int8"),
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = read_config(out / "run.toml")
    assert run["sync"]["sync_every"] == 6 and run["sync"]["uplink_codec"] == "int8"  # file and flag
    assert run["run"]["steps"] == 6 and run["server"]["min_workers"] == 2
    # the children had no other way to these settings: a worker ran the file's steps, and the shard
    # accepted the workers' int8 pushes (the codec is in the fingerprint)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mirrors_match_masters"] and all(w["steps"] == 6 for w in summary["workers"])


def test_a_scripts_own_defaults_survive_resolve():
    """A benchmark script that sets its own defaults on the shared flags (benchmarks/quality.py: 1200 steps)
    keeps them unless a flag or a config file says otherwise."""
    import argparse

    from streamdiloco.compare import add_sim_flags

    p = argparse.ArgumentParser()
    add_sim_flags(p)
    p.set_defaults(steps=1200, eval_batches=16)
    args = p.parse_args([])
    resolve(args, args.sections, None)
    assert (args.steps, args.eval_batches) == (1200, 16)
    args = p.parse_args(["--steps", "5"])
    resolve(args, args.sections, None)
    assert args.steps == 5
