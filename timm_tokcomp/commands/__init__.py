"""The commands' jobs, each one folder or module (bench, tune, analyze, speed, calibrate, selfcheck), and the
fast-path chooser they share (paths). A command imports the floors below it, never a sibling command; the CLI
(timm_tokcomp/cli/) ties them to flags."""
