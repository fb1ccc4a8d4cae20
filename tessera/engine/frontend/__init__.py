"""Driving an engine core from the server: the async engine, and the core in its own process."""
