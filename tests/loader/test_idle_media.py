"""Idle media for every family with a vision or audio tower (``loader.training.with_idle_media``):
a micro-batch without images (videos, clips) gets the smallest black (silent) one its model
takes, as a masked sample of its own, so that under FSDP every rank calls the tower alike. On
tiny random InternVL, LLaVA-OneVision, Gemma 3, Gemma 4, GLM-V, Qwen2-Audio, Qwen2.5-Omni and
Qwen3-Omni models (Qwen2-VL:
tests/loader/test_training.py): the model takes the batch, no real logit changes, the loss is
the same, and the tower runs and gets exactly-zero gradients."""

from __future__ import annotations

import pytest
import torch

from loader import PackedBatch, collate_packed
from loader.attention import model_masks, with_model_masks
from loader.training import idle_media_settings, summed_loss, with_idle_media
from tests.models.build import tiny_models

LENGTHS = (9, 70, 11)  # Gemma 3: a sample longer than its sliding window (64)
EXPECTED = {  # model type: (kind, pixel key, pixel shape, tokens) of each idle item
    "internvl": [("image", "pixel_values", (1, 3, 448, 448), 256)],
    "llava_onevision": [
        ("image", "pixel_values", (2, 1, 3, 384, 384), 2 * (729 + 1)),
        ("video", "pixel_values_videos", (1, 1, 3, 384, 384), 196 + 1),
    ],
    "gemma3": [("image", "pixel_values", (1, 3, 896, 896), 256)],
    "gemma4": [  # one pooling block of 3 × 3 patches of 16 px each, an image and a one-frame video
        ("image", "pixel_values", (1, 9, 768), 1),
        ("video", "pixel_values_videos", (1, 9, 768), 1),
    ],
    "glm4v": [("image", "pixel_values", (4, 3 * 2 * 14 * 14), 1)],  # videos too reach its tower as images
    "qwen2_audio": [("audio", "input_features", (1, 128, 3000), 2)],  # 7 frames kept of 30 s of features
    "qwen2_5_omni_thinker": [  # Qwen-VL's merged token of an image and a video, a clip of 3 frames
        ("image", "pixel_values", (4, 3 * 2 * 14 * 14), 1),
        ("video", "pixel_values_videos", (4, 3 * 2 * 14 * 14), 1),
        ("audio", "input_features", (1, 128, 3), 1),
    ],
    "qwen3_omni_moe_thinker": [  # patch 16; a clip of 1 frame (its chunked encoder's 1 token)
        ("image", "pixel_values", (4, 3 * 2 * 16 * 16), 1),
        ("video", "pixel_values_videos", (4, 3 * 2 * 16 * 16), 1),
        ("audio", "input_features", (1, 128, 1), 1),
    ],
}


def text_bin(model_type: str) -> dict:
    """One bin of three text-only samples, as ``PackedDataset`` yields it for the family."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(300, 5000, (sum(LENGTHS),), generator=generator)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    labels = ids.clone()
    labels[cu[:-1].long()] = -100
    item = {
        "input_ids": ids, "labels": labels, "cu_seqlens": cu, "max_seqlen": max(LENGTHS),
        "position_ids": torch.cat([torch.arange(n) for n in LENGTHS]), "sample_ids": ["a", "b", "c"],
    }  # fmt: skip
    if model_type == "internvl":
        item["boundary_kwargs"] = False
    if model_type in ("gemma3", "gemma4"):
        item.update(media_token_mask=torch.zeros(len(ids), dtype=torch.bool), sliding_window=64)
        item["global_media_blocks"] = model_type == "gemma3"  # Gemma 4: image blocks on sliding layers
    # mRoPE: text-only samples count on all three rows
    if model_type in ("glm4v", "qwen2_5_omni_thinker", "qwen3_omni_moe_thinker"):
        item["mrope_position_ids"] = item["position_ids"].expand(3, -1)
    return item


def vision_parameters(model) -> list[torch.nn.Parameter]:
    towers = ("vision_tower", ".visual.", "audio_tower")
    return [p for name, p in model.named_parameters() if any(tower in name for tower in towers)]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("model_type", sorted(EXPECTED))
def test_idle_media_change_no_real_logit_and_give_the_vision_tower_zero_gradients(model_type, attention):
    model = tiny_models().tiny_model(model_type, seed=3, attn_implementation=attention)
    plain = collate_packed([text_bin(model_type)])
    idle = with_idle_media(plain, idle_media_settings(model.config))
    length = plain["input_ids"].shape[1]
    added = [(i.kind, i.pixel_key, i.pixel_shape, i.tokens) for i in idle_media_settings(model.config)]
    assert added == EXPECTED[model_type]
    assert idle.meta["idle_media"] == [kind for kind, *_ in added]
    assert idle["input_ids"].shape[1] == length + sum(tokens for *_, tokens in added)
    assert idle.meta["cu_seq_lens"][:4] == plain.meta["cu_seq_lens"] and idle.meta["supervised_tokens"] == 87
    assert (idle["labels"][0, length:] == -100).all()
    for _, key, shape, _ in added:
        assert idle[key].shape == shape and not idle[key].any()

    def logits(batch):
        inputs = {k: v for k, v in with_model_masks(batch, model).items() if k != "labels"}
        return model(**inputs).logits[0, :length]

    with torch.no_grad():
        torch.testing.assert_close(logits(idle), logits(plain), rtol=0, atol=1e-5)

    vision = vision_parameters(model)
    summed_loss(model, plain).backward()
    assert all(p.grad is None for p in vision)  # the tower sat out: an FSDP rank would not gather it
    model.zero_grad(set_to_none=True)
    loss = summed_loss(model, idle)
    loss.backward()
    ran = [p for p in vision if p.grad is not None]  # (LLaVA-OneVision reads no post_layernorm)
    assert len(ran) >= len(vision) - 2 and not any(p.grad.any() for p in ran)  # it ran, trained nothing
    model.zero_grad(set_to_none=True)
    torch.testing.assert_close(loss, summed_loss(model, plain), rtol=1e-6, atol=0)


def test_gemma3_idle_image_is_a_bidirectional_block_of_its_own():
    """The idle image's tokens see each other (later ones too, within the sliding window) and
    nothing else; the real samples' masks are unchanged."""
    model = tiny_models().tiny_model("gemma3", seed=3)
    plain = collate_packed([text_bin("gemma3")])
    idle = with_idle_media(plain, idle_media_settings(model.config))
    length = plain["input_ids"].shape[1]
    for kind, mask in idle["attention_mask"].items():
        assert torch.equal(mask[..., :length, :length], plain["attention_mask"][kind])
        assert not mask[..., :length, length:].any() and not mask[..., length:, :length].any()
    block = idle["attention_mask"]["full_attention"][0, 0, length:, length:]
    assert block.all()
    sliding = idle["attention_mask"]["sliding_attention"][0, 0, length:, length:]
    assert sliding[0].all() and not sliding[200, :100].any()  # bidirectional, 64 keys back
    additive = model_masks(plain["attention_mask"], "eager", torch.bfloat16)
    converted = PackedBatch({**plain, "attention_mask": additive}, plain.meta)
    with pytest.raises(ValueError, match="before converting the masks"):
        with_idle_media(converted, idle_media_settings(model.config))
