"""The measuring kit below the commands (bench, speed, tune, calibrate, analyze, the trainers): execution modes and
the one runner, statistics, the --methods grammar, the preset format, the agreement evaluation, the fast-path
chooser and the one-call deployment of a preset. Each module has one job; the commands import these, never each
other."""
