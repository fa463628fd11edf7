"""The WAN benchmark's report: its event-model column counts the bytes of the codecs the run was given."""

from __future__ import annotations

from benchmarks.wan.report import _codec_flags, predict_runs


def test_the_codec_flags_of_a_run_are_read_in_both_spellings_and_others_ignored():
    flags = "--uplink-codec topk --downlink-codec=sq2 --codec-block-size 1024 --fragment-sync-delay 3"
    assert _codec_flags(flags) == {"uplink_codec": "topk", "downlink_codec": "sq2", "codec_block_size": 1024}
    assert _codec_flags("") == {} and _codec_flags("--uplink-codec") == {}


def test_the_prediction_of_a_run_with_fewer_bytes_is_higher_on_the_same_slow_link():
    settings = {"model": "tiny", "seed": 0, "block_size": None, "num_fragments": 5, "sync_every": 30,
                "workers": 2, "steps": 300}  # fmt: skip
    run = [{"system": "sdl", "rate_mbit": 0.5, "delay_ms": 25, "t_ref": 0.19}]
    e3m0 = predict_runs(run, settings, "adaptive")[0][1]
    sq2 = predict_runs(run, {**settings, "sdl_flags": "--uplink-codec sq2 --downlink-codec sq2"}, "adaptive")[
        0
    ][1]
    assert 0 < e3m0 < sq2 <= 1
