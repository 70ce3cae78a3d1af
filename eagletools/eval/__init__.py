"""Benchmark questions, the eval runner, metrics and reports."""

from eagletools.eval.questions import Question, load_benchmark
from eagletools.eval.report import write_report
from eagletools.eval.runner import evaluate, run_eval

__all__ = ["Question", "evaluate", "load_benchmark", "run_eval", "write_report"]
