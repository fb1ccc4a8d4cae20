"""Deployments of one model over several engines: replica sets, routing policies, prefill/decode disaggregation."""
