"""Tiny stand-ins for what cannot be downloaded here, shared by the metric benchmarks and the tests (which import
them from here; a benchmark never imports the tests): a GenEval 2 benchmark file in the reference's schema and a
random-init Qwen3-VL judge saved with ``save_pretrained``."""

import json

import torch

GENEVAL2_ROWS = [
    {
        "prompt": "two red cats",
        "atom_count": 3,
        "vqa_list": [
            ["How many cats are in the image?", "two"],
            ["Are the cats red?", "Yes"],
            ["Are there any cats in the image?", "Yes"],
        ],
        "skills": ["count", "attribute", "object"],
    },
    {
        "prompt": "a dog in front of four blue cows",
        "atom_count": 4,
        "vqa_list": [
            ["Are there any dogs in the image?", "Yes"],
            ["Is the dog in front of the cows?", "Yes"],
            ["How many cows are in the image?", "four"],
            ["Are the cows blue?", "Yes"],
            ["Are there any cows in the image?", "Yes"],
        ],
        "skills": ["object", "position", "count", "attribute", "object"],
    },
    {
        "prompt": "a white cat",
        "atom_count": 2,
        "vqa_list": [["Is the cat white?", "Yes"], ["Are there any cats in the image?", "Yes"]],
        "skills": ["attribute", "object"],
    },
]


def geneval2_benchmark(path, rows=GENEVAL2_ROWS):
    """A benchmark file in the reference's schema (``geneval2_data.jsonl``)."""
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def tiny_vlm_judge(path, seed: int = 0, logit_scale: float = 40.0):
    """A random-init Qwen3-VL (the reference judge's class) with a word-level tokenizer, Qwen's chat format and the
    Qwen2-VL image processor, saved with ``save_pretrained``. The output head is scaled so its next-token
    distribution is far from uniform (random init gives ~1/vocab everywhere, which would test nothing)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2VLImageProcessor,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLProcessor,
    )
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
    special.append("<|video_pad|>")
    text = " ".join(f"{q} {a} {a.lower()}" for r in GENEVAL2_ROWS for q, a in r["vqa_list"])
    words = set(text.replace("?", " ?").split())
    words |= {"user", "assistant", "Answer", "in", "one", "word", ".", "No", "no", "1", "2", "3", "4", "Two", "Four"}
    vocab = {t: i for i, t in enumerate(["[UNK]", *special, *sorted(words)])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(r"<\|[a-z_]+\|>", "isolated"), pre_tokenizers.Whitespace()]
    )
    chat = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}{% if c['type'] == 'image' %}"
        "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="[UNK]",
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        additional_special_tokens=special,
    )
    vision = dict(patch_size=16, merge_size=2, temporal_patch_size=2)
    processor = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(**vision, min_pixels=32 * 32, max_pixels=64 * 64),
        tokenizer=fast,
        video_processor=Qwen3VLVideoProcessor(**vision),
        chat_template=chat,
    )
    ids = {t: vocab[t] for t in special}
    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=len(vocab),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=512,
            pad_token_id=ids["<|endoftext|>"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=4,
            out_hidden_size=32,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            num_position_embeddings=16,
            deepstack_visual_indexes=[0],
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path
