"""Build a tiny random-weight Qwen2-VL checkpoint offline, for end-to-end tests on CPU.

    python tests/e2e/build_tiny_vl.py OUTDIR
    python tests/e2e/build_tiny_vl.py OUTDIR --shape qwen2.5-vl-7b

The second writes no weights: Qwen2.5-VL-7B-Instruct's configuration (its text and vision shapes,
its special-token ids, its image processor's pixel limits) with the same byte-level tokenizer,
padded to the model's 152064-entry vocabulary so that every id decodes; serve it with vLLM's
``--load-format dummy``. A 1024x1024 image is then 1369 embeddings of width 3584 (9.8 MB in
bf16), and the vision tower and the LM cost what they really cost.

No hub access and no files from anywhere: byte-level tokenizer, random bf16 weights from a fixed
seed (same bytes on every run), a Qwen2-VL processor and a minimal chat template that renders any
number of ``image_url`` parts. ~0.6 M parameters, ~1.3 MB on disk, builds in a few seconds.

Text: hidden 128, 2 layers, 2 heads (1 KV head), head_dim 64, vocab 512.
Vision: depth 1, embed 64, patch 14, merge 2 -> an image gives 4..16 encoder tokens
(min_pixels 56x56, max_pixels 112x112), so 4 images per prompt fit easily in a 1024-token context.
Special ids: <|endoftext|>=256 <|im_start|>=257 <|im_end|>=258 <|vision_start|>=259
<|vision_end|>=260 <|image_pad|>=261 <|video_pad|>=262. Sampled ids are mostly >= 263 and decode
to '': compare token ids, not text. Model files are build outputs; never commit them.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor, Qwen2VLProcessor
from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer
from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

SEED = 0
SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' or c['type'] == 'image_url' or 'image' in c %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PIXELS = dict(min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14, temporal_patch_size=2, merge_size=2)


def _byte_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (the byte-level BPE alphabet)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in bs]
    return [chr(b) for b in bs] + [chr(256 + n) for n in range(len(rest))]


def build(out: str) -> dict[str, int]:
    """Write the checkpoint into ``out``; return the special-token ids."""
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(SEED)

    vocab = {ch: i for i, ch in enumerate(_byte_alphabet())}  # no merges: one token per byte
    for s in SPECIALS:
        vocab[s] = len(vocab)
    ids = {s: vocab[s] for s in SPECIALS}
    tok = Qwen2Tokenizer(
        vocab=vocab, merges=[], unk_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tok.add_special_tokens({"additional_special_tokens": list(SPECIALS[1:])})
    for s in SPECIALS:
        assert tok.convert_tokens_to_ids(s) == ids[s], s
    tok.chat_template = CHAT_TEMPLATE
    proc = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(**PIXELS),
        video_processor=Qwen2VLVideoProcessor(**PIXELS),
        tokenizer=tok,
        chat_template=CHAT_TEMPLATE,
    )

    hidden, head_dim = 128, 64
    cfg = Qwen2VLConfig(
        text_config=dict(
            vocab_size=512,
            hidden_size=hidden,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=hidden // head_dim,
            num_key_value_heads=1,
            max_position_embeddings=4096,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]},
            bos_token_id=ids["<|endoftext|>"],
            eos_token_id=ids["<|im_end|>"],
            tie_word_embeddings=False,
        ),
        vision_config=dict(
            depth=1,
            embed_dim=64,
            hidden_size=hidden,
            num_heads=2,
            mlp_ratio=2,
            in_channels=3,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    cfg.architectures = ["Qwen2VLForConditionalGeneration"]
    Qwen2VLForConditionalGeneration(cfg).to(torch.bfloat16).save_pretrained(out)
    proc.save_pretrained(out)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"]}, f)
    return ids


# Qwen2.5-VL-7B-Instruct's special tokens at their ids (ours: a subset, the rest of the vocabulary
# is filler that only decoding ever meets).
QWEN_IDS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|vision_start|>": 151652,
            "<|vision_end|>": 151653, "<|image_pad|>": 151655, "<|video_pad|>": 151656}
QWEN_VOCAB = 152064


def build_qwen25_vl_7b_shapes(out: str) -> dict[str, int]:
    """Qwen2.5-VL-7B-Instruct's configuration, processor and a byte-level tokenizer; no weights."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLProcessor

    os.makedirs(out, exist_ok=True)
    vocab = {ch: i for i, ch in enumerate(_byte_alphabet())}
    taken = {v: k for k, v in QWEN_IDS.items()}
    for i in range(len(vocab), QWEN_VOCAB):
        vocab[taken.get(i, f"<x{i}>")] = i
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token="<|endoftext|>", eos_token="<|im_end|>",
                         pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": list(SPECIALS[1:])})
    for s, i in QWEN_IDS.items():
        assert tok.convert_tokens_to_ids(s) == i, s
    tok.chat_template = CHAT_TEMPLATE
    pixels = dict(min_pixels=56 * 56, max_pixels=28 * 28 * 16384, patch_size=14, temporal_patch_size=2, merge_size=2)
    proc = Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessor(**pixels),
                               video_processor=Qwen2VLVideoProcessor(**pixels), tokenizer=tok,
                               chat_template=CHAT_TEMPLATE)
    cfg = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=QWEN_VOCAB, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
            num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000, rms_norm_eps=1e-6,
            max_window_layers=28, use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
            bos_token_id=QWEN_IDS["<|endoftext|>"], eos_token_id=QWEN_IDS["<|im_end|>"], tie_word_embeddings=False,
        ),
        vision_config=dict(
            depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, in_channels=3, out_hidden_size=3584,
            patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
            fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2, hidden_act="silu",
        ),
        image_token_id=QWEN_IDS["<|image_pad|>"], video_token_id=QWEN_IDS["<|video_pad|>"],
        vision_start_token_id=QWEN_IDS["<|vision_start|>"], vision_end_token_id=QWEN_IDS["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    cfg.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(out)
    proc.save_pretrained(out)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": QWEN_IDS["<|im_end|>"], "pad_token_id": QWEN_IDS["<|endoftext|>"]}, f)
    return dict(QWEN_IDS)


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) == 3 and args[1] == "--shape" and args[2] == "qwen2.5-vl-7b":
        print("built (no weights: --load-format dummy)", args[0], build_qwen25_vl_7b_shapes(args[0]))
    elif len(args) == 1:
        print("built", args[0], build(args[0]))
    else:
        sys.exit("usage: build_tiny_vl.py OUTDIR [--shape qwen2.5-vl-7b]")
