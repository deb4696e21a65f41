"""Model shapes: transcription checks against published sizes and the paper's §3.2 numbers."""

from __future__ import annotations

import pytest

from kvserve.memory import KVCacheManager, LayerKind
from kvserve.memory.baselines import POLICIES
from kvserve.sim.models import MODELS, get_model

KiB = 1 << 10


@pytest.mark.parametrize("name", sorted(MODELS))
def test_derived_params_match_published(name: str) -> None:
    m = get_model(name)
    ratio = m.derived_params() / m.params
    if m.image_tokens_per_tile or name.startswith("gemma-3"):
        # The published count includes a vision tower the text shapes do not cover.
        assert 0.88 < ratio < 1.0
    else:
        assert ratio == pytest.approx(1.0, abs=0.01)


def _layout(name: str) -> dict[str, tuple[LayerKind, int, int]]:
    return {s.name: (s.kind, s.num_layers, s.window or s.chunk)
            for s in get_model(name).kv_specs()}


def test_layer_patterns() -> None:
    assert _layout("ministral-8b") == {"full": (LayerKind.FULL, 9, 0),
                                       "sliding": (LayerKind.SLIDING, 27, 32768)}
    assert _layout("gemma-3-12b") == {"full": (LayerKind.FULL, 8, 0),
                                      "sliding": (LayerKind.SLIDING, 40, 1024)}
    assert _layout("gemma-2-27b") == {"full": (LayerKind.FULL, 23, 0),
                                      "sliding": (LayerKind.SLIDING, 23, 4096)}
    assert _layout("llama-3.2-11b-vision") == {"self": (LayerKind.FULL, 32, 0),
                                               "cross": (LayerKind.CROSS, 8, 0)}
    assert _layout("llama-4-scout") == {"full": (LayerKind.FULL, 12, 0),
                                        "chunked": (LayerKind.CHUNKED, 36, 8192)}
    assert _layout("jamba-1.5-mini") == {"full": (LayerKind.FULL, 4, 0),
                                         "mamba": (LayerKind.MAMBA, 28, 0)}
    assert _layout("bamba-9b") == {"full": (LayerKind.FULL, 3, 0),
                                   "mamba": (LayerKind.MAMBA, 29, 0)}


def test_bytes_per_token_and_state() -> None:
    assert get_model("llama-3.1-8b").kv_bytes_per_token() == 4 * KiB  # 8 heads x 128 x K,V x bf16
    assert get_model("gemma-3-12b").kv_bytes_per_token() == 8 * KiB
    assert get_model("ministral-8b").kv_bytes_per_token(1) == 2 * KiB  # FP8 KV
    # Jamba: d_inner 8192 x (conv 3 + state 16) x bf16.
    assert get_model("jamba-1.5-mini").mamba_state_bytes() == 8192 * 19 * 2


def test_fp8_weights_halve_the_linear_layers() -> None:
    m = get_model("llama-3.1-70b")
    assert m.weight_bytes(True) == pytest.approx(m.weight_bytes(False) - m.linear_params())


# Models whose natural LCM page the LCM layouts (jenga, static) refuse at 16-token
# pages: (attention page tokens, state page padded to a multiple of that many tokens' KV).
PADDED = {"bamba-9b": (32, 32)}


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("policy", POLICIES)
def test_every_model_builds_under_every_policy(name: str, policy: str) -> None:
    m, T = get_model(name), 16
    specs = m.kv_specs()
    if name in PADDED and policy in ("jenga", "static"):
        T, pad = PADDED[name]
        specs = m.kv_specs(state_page_multiple=pad * 3 * m.kv_bytes_per_token())
    kv = KVCacheManager(specs, 2 << 30, T, policy=policy)
    assert kv.num_large_pages >= len(kv.layout.specs)


def test_bamba_mamba2_state_and_layouts() -> None:
    m = get_model("bamba-9b")
    # conv over x, B, C: (8192 + 2 x 1 x 128) x 3; SSM: 128 heads x 64 x 128; bf16.
    assert m.mamba_state_bytes() == (8448 * 3 + 128 * 64 * 128) * 2 == 2147840
    specs = m.kv_specs()
    # 2147840 = 2^9 x 5 x 839: the LCM with a 16-token attention page is refused.
    with pytest.raises(ValueError, match="unreasonable"):
        KVCacheManager(specs, 8 << 30, 16)
    att = 3 * m.kv_bytes_per_token()
    padded = m.kv_specs(state_page_multiple=32 * att)
    kv = KVCacheManager(padded, 8 << 30, 32)
    assert kv.layout.page_bytes == (32 * att, 159 * 32 * att)  # state page padded 0.38%
    assert kv.layout.page_bytes[1] / (29 * m.mamba_state_bytes()) == pytest.approx(1.0038, abs=1e-4)
    vllm = KVCacheManager(specs, 8 << 30, 16, policy="vllm_align")
    assert vllm.T == 528  # vLLM's attention block for Bamba 9B
    assert get_model("jamba-1.5-mini").kv_specs(checkpoint_every=80)[1].checkpoint_every == 80


def _uniform_waste(name: str, text: int, images=()) -> float:
    """Waste of one request held whole under the uniform (vLLM) layout."""
    kv = KVCacheManager(get_model(name).kv_specs(), 64 << 30, 16, policy="uniform")
    kv.add_request("r", list(range(text)), images)
    assert kv.allocate_slots("r", text)
    kv.advance("r", text - 1)  # the next query sits at the last position
    return kv.stats().waste_fraction


def test_paper_section_3_2_waste() -> None:
    """§3.2: up to 56.25% (Ministral, 128k) and 25% (Gemma 2, 8k) waste; 79.6% for MMMU-pro."""
    from kvserve.memory import ImageInput

    assert _uniform_waste("ministral-8b", 131072) == pytest.approx(0.5625, abs=0.001)
    assert _uniform_waste("gemma-2-27b", 8192) == pytest.approx(0.25, abs=0.001)
    image = (ImageInput("img", 0, 6193),)
    assert _uniform_waste("llama-3.2-11b-vision", 43, image) == pytest.approx(0.796, abs=0.002)
