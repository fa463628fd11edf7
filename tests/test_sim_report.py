"""sim/report.py in closed form: the byte counts as `compare` prints them, each run's row against the
data-parallel run of the same M (loss in percent, bytes and peak as factors), the table in text and in
Markdown, and the plot written as a PNG. The whole `streamdiloco compare` is tests/test_cli.py's (slow).
"""

from __future__ import annotations

from streamdiloco.sim.report import comparison_rows, fmt_bytes, format_table, plot_curves


def run(method: str, loss: float, sent: float, received: float, peak: float, workers: int = 2) -> dict:
    curve = [{"step": 0, "tokens": 0, "eval_loss": 9.0}, {"step": 6, "tokens": 768, "eval_loss": loss}]
    return {
        "method": method,
        "workers": workers,
        "eval_loss": loss,
        "bytes_sent_per_worker": sent,
        "bytes_received_per_worker": received,
        "peak_sync_bytes": peak,
        "tokens": 12_288,
        "wall_seconds": 4.4,
        "curve": curve,
    }


RESULTS = [("dp", run("dp", 2.0, 3e6, 3e6, 4e5)), ("full", run("streaming", 2.1, 30e3, 30e3, 1e4))]


def test_bytes_are_printed_in_powers_of_a_thousand():
    assert [fmt_bytes(n) for n in (999, 1000, 1_234_567, 2.5e9, 7e12, 3e15)] == [
        "999 B",
        "1.00 KB",
        "1.23 MB",
        "2.50 GB",
        "7.00 TB",
        "3000.00 TB",
    ]


def test_each_run_is_compared_with_the_data_parallel_run_of_its_m():
    dp, full = comparison_rows(RESULTS)
    assert (dp["vs_dp_pct"], dp["fewer_bytes_x"], dp["peak_vs_dp_x"]) == (0.0, 1.0, 1.0)
    assert round(full["vs_dp_pct"], 6) == 5.0  # 2.1 against 2.0
    assert full["fewer_bytes_x"] == 100.0 and full["peak_vs_dp_x"] == 40.0
    (alone,) = comparison_rows([("full", run("streaming", 2.1, 1.0, 1.0, 1.0, workers=4))])
    assert alone["vs_dp_pct"] is alone["fewer_bytes_x"] is alone["peak_vs_dp_x"] is None  # no DP at M = 4


def test_the_table_in_text_and_in_markdown():
    rows = comparison_rows(RESULTS)
    text = format_table(rows).splitlines()
    assert text[0].split()[:3] == ["method", "M", "eval"] and set(text[1]) <= {"-", " "}
    assert text[3].split() == ["full", "2", "2.1000", "+5.00%", "30.00", "KB", "30.00", "KB", "100×"] + [
        "10.00",
        "KB",
        "40.0×",
        "12,288",
        "4s",
    ]
    md = format_table(rows, markdown=True).splitlines()
    assert md[1] == "|" + "---|" * 11
    assert md[2].startswith("| dp | 2 | 2.0000 | +0.00% | 3.00 MB | 3.00 MB | 1× |")


def test_the_plot_is_written_where_asked(tmp_path):
    path = plot_curves(RESULTS, tmp_path / "plots" / "loss.png", title="t")
    assert path == tmp_path / "plots" / "loss.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
