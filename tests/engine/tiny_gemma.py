"""A tiny random Gemma 3 and a byte tokenizer: every engine mechanism in milliseconds."""

import torch

from kvserve.models import Gemma3Config, Gemma3ForCausalLM

VOCAB = 300


class ByteTokenizer:
    """Enough of a tokenizer for the engine: ids are bytes + 3."""

    def encode(self, text):
        return [2] + [b + 3 for b in text.encode()]

    def decode(self, ids, skip_special_tokens=True):
        return bytes(max(0, i - 3) % 256 for i in ids if i >= 3).decode(errors="replace")


def tiny_gemma() -> Gemma3ForCausalLM:
    """4 layers (sliding, full, sliding, full), window 8, weights N(0, 0.5), seeded."""
    torch.manual_seed(0)
    cfg = Gemma3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention",
                     "full_attention"],
        max_position_embeddings=512, eos_token_ids=[1],
    )
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model
