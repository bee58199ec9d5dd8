"""Reproducible one-off jobs (pretraining the embedded models). Run with `python -m scripts.<name>`."""
