"""`tokcomp bench`: several methods against the plain model in one run (bench.run), and their table, CSV and plot
(bench.report)."""
from .report import check_plot_format, format_table, plot_pareto, write_csv
from .run import BenchRow, build_method_models, run_bench

__all__ = ["BenchRow", "build_method_models", "check_plot_format", "format_table", "plot_pareto", "run_bench",
           "write_csv"]
