"""See what a reducer does: recording what every patch became (record), the study's pattern metrics
(metrics), pictures (plots) and the `tokcomp analyze` report (report). Reads the models' source maps;
never changes how a model runs. Needs the `analysis` extra (scipy, scikit-learn) for the metrics."""
