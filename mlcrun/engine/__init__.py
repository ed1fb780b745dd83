"""Scheduling, sampling and generation over a ModelRunner. Never imports TVM."""
