"""Evaluation suites: each writes JSON (config, per-sample results, summary) and a plot."""
