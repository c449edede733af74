"""Evaluation harness: datasets, experiment configs, resumable result files, reports and plots."""
