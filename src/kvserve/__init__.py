"""kvserve: an LLM serving engine built around its KV-cache memory system."""
