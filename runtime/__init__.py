"""Execution: collectives, pipeline action lists and schedules, simulator, executor."""
