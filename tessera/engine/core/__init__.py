"""The engine core's decisions: requests, scheduling, KV blocks, the step-cost model."""
