"""kvserve: an LLM serving engine built around its KV-cache memory system."""

from kvserve.engine.request import RequestOutput, SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; keep `import kvserve` light.
    if name == "LLM":
        from kvserve.engine.llm import LLM

        return LLM
    raise AttributeError(name)
