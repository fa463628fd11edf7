"""Issue 38, part 6: what a push costs on the wire beyond its codec bytes, counted without a network
(benchmarks/wire/pushframing.py; the bytes benchmark checks the count against a proxy's): a top-k push of
one of tiny's fragments (a few KB) and the default E3M0 push keep their framing under 5 %."""

import pytest

from benchmarks.wire.pushframing import LIMIT_PCT, fragment_pushes

pytestmark = pytest.mark.timeout(120)


def test_a_few_kb_top_k_push_and_an_e3m0_push_frame_under_five_percent():
    topk = fragment_pushes("tiny", "topk64_4096", 1024)
    e3m0 = fragment_pushes("tiny", "e3m0", 128)  # the defaults: e3m0 at block 128
    for r in e3m0:
        assert r["framing_pct"] < 1, r
    few_kb = [r for r in topk if r["codec_bytes"] > 4000]  # tiny's four large fragments: 6,167 B each
    assert len(few_kb) == 4
    for r in few_kb:
        assert r["codec_bytes"] < 8000 and r["framing_pct"] < LIMIT_PCT, r
    # a push in one chunk and one frame (up to 16 KB) costs about 130 B beside its codec bytes whatever its
    # size, most of it the PushHeader; so any push above 3 KB stays under 5 %
    for r in topk + e3m0:
        assert r["header"] <= 80, r
        if r["codec_bytes"] < 16000:
            assert r["grpc_http2"] == 14 and r["framing"] <= 150, r
        assert r["framing"] == r["protobuf"] + r["grpc_http2"]
        assert r["protobuf"] == r["chunk_fields"] + r["header"] + r["wrappers"]
