"""Tiny stand-ins for what cannot be downloaded here, shared by the metric benchmarks and the tests (which import
them from here; a benchmark never imports the tests): a GenEval 2 benchmark file in the reference's schema, a
random-init Qwen3-VL judge saved with ``save_pretrained``, a tiny open_clip model config with its checkpoint, and
torch-fidelity's Inception layout with random weights."""

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


def tiny_open_clip_config(tmp_path):
    import json

    import open_clip

    cfg = {
        "embed_dim": 16,
        "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 16},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
    }
    (tmp_path / "tiny-test-clip.json").write_text(json.dumps(cfg))
    open_clip.add_model_config(tmp_path / "tiny-test-clip.json")
    torch.manual_seed(0)
    model = open_clip.create_model("tiny-test-clip", pretrained=None)
    path = tmp_path / "tiny_clip.pt"
    torch.save({"state_dict": {f"module.{k}": v for k, v in model.state_dict().items()}, "epoch": 1}, path)
    return model, path


def random_inception_state_dict():
    """torch-fidelity's FID InceptionV3 layer layout with random weights (what its weights file holds)."""
    from torch import nn
    from torch_fidelity import feature_extractor_inceptionv3 as tf

    torch.manual_seed(0)
    layers = {
        "Conv2d_1a_3x3": tf.BasicConv2d(3, 32, kernel_size=3, stride=2),
        "Conv2d_2a_3x3": tf.BasicConv2d(32, 32, kernel_size=3),
        "Conv2d_2b_3x3": tf.BasicConv2d(32, 64, kernel_size=3, padding=1),
        "Conv2d_3b_1x1": tf.BasicConv2d(64, 80, kernel_size=1),
        "Conv2d_4a_3x3": tf.BasicConv2d(80, 192, kernel_size=3),
        "Mixed_5b": tf.InceptionA(192, pool_features=32),
        "Mixed_5c": tf.InceptionA(256, pool_features=64),
        "Mixed_5d": tf.InceptionA(288, pool_features=64),
        "Mixed_6a": tf.InceptionB(288),
        "Mixed_6b": tf.InceptionC(768, channels_7x7=128),
        "Mixed_6c": tf.InceptionC(768, channels_7x7=160),
        "Mixed_6d": tf.InceptionC(768, channels_7x7=160),
        "Mixed_6e": tf.InceptionC(768, channels_7x7=192),
        "Mixed_7a": tf.InceptionD(768),
        "Mixed_7b": tf.InceptionE_1(1280),
        "Mixed_7c": tf.InceptionE_2(2048),
        "fc": nn.Linear(2048, 1008),
    }
    return nn.ModuleDict(layers).state_dict()
