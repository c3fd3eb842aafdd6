"""The DFlash drafter against the `dflash` package (same random weights, float32, 1e-5)."""

import json
import os

import pytest
import torch

from hf_utils import one_thread, tiny_drafter, tiny_target
from vllm_ddtree.hf.drafter import DFlashDrafter, DrafterCache, DrafterConfig, default_target_layer_ids

dflash_model = pytest.importorskip("dflash.model")


_threads = pytest.fixture(scope="module", autouse=True)(one_thread)


def reference(drafter: DFlashDrafter):
    """dflash.model.DFlashDraftModel holding our weights."""
    from transformers import Qwen3Config

    raw = drafter.config.to_dict()
    raw.pop("architectures")
    cfg = Qwen3Config(**raw)
    cfg._attn_implementation = "sdpa"
    ref = dflash_model.DFlashDraftModel(cfg).float().eval()
    missing, unexpected = ref.load_state_dict(drafter.state_dict(), strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return ref


def test_default_target_layer_ids_match_dflash():
    for n_target, n_draft in [(36, 5), (4, 1), (28, 3), (8, 2)]:
        assert default_target_layer_ids(n_target, n_draft) == dflash_model.build_target_layer_ids(n_target, n_draft)
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]


@pytest.mark.parametrize("layers", [1, 2])
def test_forward_matches_dflash_without_cache(layers):
    target = tiny_target()
    drafter = tiny_drafter(target, layers=layers)
    ref = reference(drafter)
    g = torch.Generator().manual_seed(0)
    ctx = torch.randn(2, 9, 2 * 64, generator=g)  # [b, C, 2 * hidden]
    noise = torch.randn(2, 4, 64, generator=g)  # [b, block, hidden]
    pos = torch.arange(13)[None].expand(2, -1)
    with torch.no_grad():
        ours = drafter(ctx, noise, pos)
        theirs = ref(position_ids=pos, noise_embedding=noise, target_hidden=ctx)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_cached_rounds_match_dflash_dynamic_cache():
    """Three rounds as dflash_generate runs them: context appended, block K/V cropped away."""
    from transformers import DynamicCache

    target = tiny_target()
    drafter = tiny_drafter(target, layers=2)
    ref = reference(drafter)
    ref_cache, cache = DynamicCache(config=ref.config), DrafterCache(2)
    g = torch.Generator().manual_seed(1)
    start = 0
    for new_ctx in [7, 1, 3]:
        ctx = torch.randn(1, new_ctx, 128, generator=g)
        noise = torch.randn(1, 4, 64, generator=g)
        start += new_ctx  # the block starts right after the committed context
        pos = torch.arange(start - new_ctx, start + 4)[None]
        with torch.no_grad():
            theirs = ref(position_ids=pos, noise_embedding=noise, target_hidden=ctx,
                         past_key_values=ref_cache, use_cache=True)
            ref_cache.crop(start)
            ours = drafter(ctx, noise, pos, cache=cache)
        assert cache.length == start
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_checkpoint_round_trip_loads_in_dflash(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target)
    drafter.save_pretrained(str(tmp_path), dtype=torch.float32)
    raw = json.load(open(tmp_path / "config.json"))
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["model_type"] == "qwen3"
    assert raw["dflash_config"] == {"mask_token_id": 63, "target_layer_ids": [0, 1]}
    assert raw["block_size"] == 4
    loaded = DFlashDrafter.from_pretrained(str(tmp_path))
    theirs = dflash_model.DFlashDraftModel.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert theirs.block_size == 4 and theirs.mask_token_id == 63 and theirs.target_layer_ids == [0, 1]
    ctx, noise, pos = torch.randn(1, 5, 128), torch.randn(1, 4, 64), torch.arange(9)[None]
    with torch.no_grad():
        a = loaded(ctx, noise, pos)
        torch.testing.assert_close(a, drafter(ctx, noise, pos), atol=0, rtol=0)
        torch.testing.assert_close(a, theirs(position_ids=pos, noise_embedding=noise, target_hidden=ctx),
                                   atol=1e-5, rtol=1e-5)


def test_bad_inputs_raise():
    drafter = tiny_drafter(tiny_target())
    with pytest.raises(ValueError, match="position_ids.shape"):
        drafter(torch.randn(1, 3, 128), torch.randn(1, 4, 64), torch.arange(6)[None])
    with pytest.raises(ValueError, match="hidden states"):
        drafter.context_features([torch.randn(1, 2, 64)] * 2)
    with pytest.raises(ValueError, match="output_multiplier"):
        DrafterConfig.from_dict(drafter.config.to_dict() | {"output_multiplier": 2.0})
    DrafterConfig.from_dict(drafter.config.to_dict() | {"output_multiplier": 1.0, "final_logit_softcapping": None})
    with pytest.raises(ValueError, match="sliding-window"):
        DrafterConfig.from_dict(drafter.config.to_dict() | {"layer_types": ["sliding_attention"]})


def test_committed_drafter_loads_in_dflash():
    path = os.path.join(os.path.dirname(__file__), "..", "vllm_ddtree", "assets", "tiny_pair", "drafter")
    ours = DFlashDrafter.from_pretrained(path)
    theirs = dflash_model.DFlashDraftModel.from_pretrained(path, dtype=torch.float32).eval()
    n_feat = len(ours.target_layer_ids) * ours.config.hidden_size
    ctx, noise = torch.randn(1, 6, n_feat), torch.randn(1, ours.block_size, ours.config.hidden_size)
    pos = torch.arange(6 + ours.block_size)[None]
    with torch.no_grad():
        torch.testing.assert_close(ours(ctx, noise, pos),
                                   theirs(position_ids=pos, noise_embedding=noise, target_hidden=ctx),
                                   atol=1e-5, rtol=1e-5)
