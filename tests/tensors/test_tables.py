"""The terminal tables of bench, speed and the kernel selfcheck: a cell wider than usual (a 95 % interval from two
rounds, a CPU batch of several seconds) widens its column instead of running into the next cell."""
import re

import pytest

from timm_tokcomp.utils.tables import text_table


def _cells(line: str):
    return re.split(r" {2,}", line.strip())


def test_columns_take_the_width_of_their_widest_cell():
    lines = text_table(["method", "x"], [["none", "1.00x"], ["tome_r8", "0.38x [0.00, 16794.47]"]], rule=True)
    assert lines[0] == "method                        x" and set(lines[1]) == {"-"} and len(lines[1]) == len(lines[0])
    assert lines[2] == "none                      1.00x"
    assert _cells(lines[3]) == ["tome_r8", "0.38x [0.00, 16794.47]"]
    with pytest.raises(ValueError, match="2 cells"):
        text_table(["a", "b"], [["only one"]])


def test_bench_cells_never_run_together():
    from timm_tokcomp.commands.bench import BenchRow, format_table

    rows = [BenchRow("none", 1.2537, None, 26.0, 1.0, None, None, 197, speedup_lo=1.0, speedup_hi=1.0,
                     latency_ms=31.75, latency_p90_ms=31.87, latency_speedup=1.0, latency_speedup_lo=1.0,
                     latency_speedup_hi=1.0),
            BenchRow("tome_r8", 0.9289, None, 33.3, 1.28, None, None, 109, speedup_lo=0.01, speedup_hi=170.88,
                     latency_ms=83.48, latency_p90_ms=128.65, latency_speedup=0.38, latency_speedup_lo=0.0,
                     latency_speedup_hi=16794.47)]
    header, _, _, wide = format_table(rows).splitlines()[:4]
    assert _cells(header)[:8] == ["method", "GMACs", "+-batch", "tput img/s", "tput x [95%]", "lat ms", "lat p90",
                                  "lat x [95%]"]
    assert _cells(wide) == ["tome_r8", "0.9289", "-", "33.3", "1.28x [0.01, 170.88]", "83.48", "128.65",
                            "0.38x [0.00, 16794.47]", "-", "-", "109"]


def test_speed_cells_never_run_together():
    from timm_tokcomp.commands.speed import SpeedRow, format_speed

    rows = [SpeedRow("eager", 1, "plain", 21.0, 1.0, None), SpeedRow("eager", 256, "plain", 233456.7, 1.0, None),
            SpeedRow("eager", 256, "tome_r16", 123456.7, 1.89, 0.91)]
    lines = format_speed(rows).splitlines()
    assert _cells(lines[1]) == ["method", "batch 1", "batch 256"]
    assert _cells(lines[2]) == ["plain", "1.00x 21.0ms", "1.00x 233456.7ms"]
    assert _cells(lines[3]) == ["tome_r16", "-", "1.89x (0.91) 123456.7ms"]


def test_selfcheck_cells_never_run_together():
    from timm_tokcomp.commands.selfcheck import StepCheck, format_checks

    lines = format_checks([StepCheck("tome_merge", "fp32", 1e-7, 1e-5, 12345.678, 0.5),
                           StepCheck("evit_prune", "bf16", 0.5, 1e-2, None, None)]).splitlines()
    assert _cells(lines[1]) == ["tome_merge", "fp32", "1.00e-07", "1e-05", "12345.678", "0.500", "24691.36x"]
    assert _cells(lines[2]) == ["evit_prune", "bf16", "5.00e-01", "1e-02", "-", "-", "-", "OFF"]
