"""Execution: the model runner, sampling and grammar masks; reads the scheduler's plain output only."""
