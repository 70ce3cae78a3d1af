"""Benchmarks, the eval runner, metrics and reports."""

from eagletools.eval.benchmarks import Question, load_benchmark
from eagletools.eval.report import write_report
from eagletools.eval.runner import Settings, load_decoders, run_eval

__all__ = ["Question", "Settings", "load_benchmark", "load_decoders", "run_eval", "write_report"]
