"""`tokcomp tune` / `timm_tokcomp.tune`: measure the training-free candidates on this device and choose the fastest
one that keeps accuracy within a budget, or none. `run` holds the stages; `space` the candidates, `select` the
choice, `store` the CSV and resume, `report` the outputs; `rows` the data they share."""
from ...core import NO_REDUCTION
from .report import OUT_FILES, TuneResult, format_table, plot_pareto, preset_paths, sample_notes, save_tuned_preset
from .rows import BUDGET_MEASURES, Candidate, Choice, TuneRow, label
from .run import tune
from .select import against_fastest_plain, choose, eager_speedups, fastest_plain, pareto_front
from .space import applicable_candidates, candidate_paths, check_space, default_modes
from .store import read_rows, write_rows

__all__ = ["tune", "TuneResult", "TuneRow", "Choice", "Candidate", "label", "BUDGET_MEASURES", "OUT_FILES",
           "NO_REDUCTION", "choose", "eager_speedups", "against_fastest_plain", "fastest_plain", "pareto_front", "candidate_paths", "applicable_candidates",
           "check_space", "default_modes", "read_rows", "write_rows", "format_table", "plot_pareto", "preset_paths",
           "sample_notes", "save_tuned_preset"]
