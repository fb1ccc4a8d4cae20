"""Tessera: a self-hosted LLM inference server."""
from tessera.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":  # imported lazily: it pulls in torch
        from tessera.llm import LLM

        return LLM
    raise AttributeError(name)
