"""How closely each metric reproduces the implementation users compare with, and how far the step each fidelity
test guards moves it: the metric table in docs/metrics.md, as a table and JSON.

Same random-init weights (the real architectures' geometry) and the same uint8 images at 64, 256 and 512 px as
``tests/metrics/test_metrics_fidelity.py``, and the same reference recipes (``metric_references.py``: torch-fidelity and
clean-fid called directly; dgm-eval, google-research/cmmd and hpsv2 re-typed from their sources).

    python benchmarks/metric_fidelity.py
"""

from __future__ import annotations

import argparse
import json
import tempfile
import warnings
from pathlib import Path

import metric_references as ref
import numpy as np
import torch
from fixtures import GENEVAL2_ROWS, geneval2_benchmark, tiny_vlm_judge

from lightning_muon.metrics import ClipFeatures, DinoV2Features, HPSv2Score
from lightning_muon.metrics import features as F


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def inception_rows(root: Path, size: int) -> list[dict]:
    weights = ref.make_inception_weights(root / "pt_inception.pth")
    real, fake = ref.smooth_images(10, size, 0), ref.smooth_images(10, size, 1)
    theirs = ref.torch_fidelity_metrics(weights, real, fake)
    ours = ref.our_inception_metrics(weights, real, fake)
    clean = ref.our_inception_metrics(weights, real, fake, resize="clean")
    names = (("FID", "fid", "frechet_inception_distance"), ("KID", "kid", "kernel_inception_distance_mean"))
    names += (("Inception Score", "is", "inception_score_mean"),)
    return [
        {
            "metric": metric,
            "reference": "torch-fidelity calculate_metrics",
            "size": size,
            "agreement": rel(ours[key], theirs[their_key]),
            "control": rel(clean[key], theirs[their_key]),
            "unit": "relative",
            "control_step": "clean-fid resize instead of TF1 bilinear",
        }
        for metric, key, their_key in names
    ]


def clean_resize_row(size: int) -> dict:
    from cleanfid.resize import make_resizer

    resizer = make_resizer("PIL", False, "bicubic", (299, 299))
    images = torch.randint(0, 256, (3, 3, size, size), generator=torch.Generator().manual_seed(size), dtype=torch.uint8)
    expected = np.stack([resizer(x) for x in images.permute(0, 2, 3, 1).numpy()])
    ours = F.clean_resize(images, 299).permute(0, 2, 3, 1).numpy().astype(np.float64)
    plain = torch.nn.functional.interpolate(images.float(), size=(299, 299), mode="bilinear").permute(0, 2, 3, 1)
    return {
        "metric": 'FID resize="clean"',
        "reference": "clean-fid make_resizer(PIL, bicubic)",
        "size": size,
        "agreement": float(np.abs(ours - expected).max()),
        "control": float(np.abs(plain.numpy() - expected).max()),
        "unit": "max |Δ| grey levels",
        "control_step": "plain bilinear resize",
    }


def dinov2_row(root: Path, size: int) -> dict:
    from transformers import Dinov2Model

    _, weights = ref.make_dinov2(root / f"dinov2_{size}")
    images = ref.smooth_images(5, size, 6, height=size * 3 // 4)
    expected = ref.dgm_eval_dinov2(weights, images)
    ours = DinoV2Features(weights)(images)
    x = F.normalize(F.pil_resize(images, 224), F.IMAGENET_MEAN, F.IMAGENET_STD)
    with torch.no_grad():
        plain = Dinov2Model.from_pretrained(weights).eval()(pixel_values=x).pooler_output
    return {
        "metric": "FD-DINOv2 features",
        "reference": "dgm-eval DINOv2Encoder (torch.hub DINOv2)",
        "size": size,
        "agreement": float((ours - expected).abs().max()),
        "control": float((plain - expected).abs().max()),
        "unit": "max |Δ| feature",
        "control_step": "transformers' size=(16,16) position interpolation",
    }


def clip_rows(files: dict, size: int) -> list[dict]:
    import open_clip

    reference = open_clip.create_model("tiny-test-clip", pretrained=None, force_quick_gelu=True)
    reference.load_state_dict(ClipFeatures(files["checkpoint"], "tiny-test-clip").model.state_dict())
    images = ref.smooth_images(4, size, 7, height=size // 2)
    expected = ref.cmmd_embeddings(reference, images, 32)
    gelu = ClipFeatures(files["checkpoint"], "tiny-test-clip", quick_gelu=False)(images)
    rows = []
    for kind, path in files.items():
        ours = ClipFeatures(path, "tiny-test-clip")(images)
        rows.append(
            {
                "metric": f"CMMD embeddings ({kind})",
                "reference": "google-research/cmmd recipe, open_clip encode_image",
                "size": size,
                "agreement": float((ours - expected).abs().max()),
                "control": float((gelu - expected).abs().max()),
                "unit": "max |Δ| embedding",
                "control_step": "GELU instead of QuickGELU",
            }
        )
    return rows


def hps_row(files: dict, size: int) -> dict:
    import open_clip
    from torchvision.transforms.functional import center_crop, resize

    prompts = ["a cat", "a dog", "a red car", "two birds"]
    images = ref.smooth_images(4, size, 8, height=size * 2 // 3)
    hps = HPSv2Score(files["checkpoint"], model_name="tiny-test-clip")
    reference = open_clip.create_model("tiny-test-clip", pretrained=None)
    reference.load_state_dict(hps.model.state_dict())
    expected = ref.hpsv2_scores(reference, images, prompts, 32)
    ours = hps.scores(images, prompts)
    x = center_crop(resize(images.float() / 255, 32, antialias=True), [32, 32])
    with torch.no_grad():
        img = torch.nn.functional.normalize(reference.encode_image(F.normalize(x, hps.mean, hps.std)), dim=-1)
        txt = torch.nn.functional.normalize(
            reference.encode_text(open_clip.get_tokenizer("tiny-test-clip")(prompts)), dim=-1
        )
    return {
        "metric": "HPSv2.1",
        "reference": "hpsv2 score() recipe (letterbox ResizeMaxSize)",
        "size": size,
        "agreement": float((ours - expected).abs().max()),
        "control": float(((img * txt).sum(-1) - expected).abs().max()),
        "unit": "max |Δ| score",
        "control_step": "center-crop resize instead of letterbox",
    }


def geneval2_rows(judge: Path, benchmark: Path, size: int) -> list[dict]:
    """Soft-TIFA atom probabilities against the judge asked the plain transformers way, one image and question at a
    time; the score against the reference's aggregation (scipy ``gmean``)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from lightning_muon.metrics.geneval2 import GenEval2

    images = ref.smooth_images(4, size, 3)
    samples = [0, 1, 2, 1]
    metric = GenEval2(benchmark, judge)
    metric.judge.batch_size = 5
    processor = AutoProcessor.from_pretrained(str(judge), local_files_only=True)
    model = AutoModelForImageTextToText.from_pretrained(str(judge), local_files_only=True).eval()
    rows = [GENEVAL2_ROWS[i] for i in samples]
    expected = [
        [ref.reference_probability(model, processor, x, q, a) for q, a in row["vqa_list"]]
        for x, row in zip(images, rows)
    ]
    flat = torch.tensor([p for s in expected for p in s])
    ours = torch.cat(metric.atom_probabilities(images, samples))
    metric.update(images, samples)
    score, reference_score = float(metric.compute()["geneval2"]), ref.reference_report(expected, rows)["geneval2"]
    metric.judge.processor.tokenizer.padding_side = "right"
    right_padded = torch.cat(metric.atom_probabilities(images, samples))
    arithmetic = 100 * float(np.mean([np.mean(s) for s in expected]))
    common = {"reference": "plain transformers judge, one chat at a time", "size": size}
    return [
        {
            "metric": "GenEval2 atom P(answer)",
            **common,
            "agreement": float((ours - flat).abs().max()),
            "control": float((right_padded - flat).abs().max()),
            "unit": "max |Δ| probability",
            "control_step": "right padding",
        },
        {
            "metric": "GenEval2 score (Soft-TIFA GM)",
            **common,
            "reference": "reference aggregation, scipy gmean",
            "agreement": rel(score, reference_score),
            "control": rel(arithmetic, reference_score),
            "unit": "rel.",
            "control_step": "arithmetic mean per prompt",
        },
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(ref.SIZES))
    parser.add_argument("--out", default="benchmarks/results/metric_fidelity.json")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        files = ref.make_clip_files(root)
        judge, benchmark = tiny_vlm_judge(root / "judge"), geneval2_benchmark(root / "geneval2_data.jsonl")
        for size in args.sizes:
            rows += geneval2_rows(judge, benchmark, size)
            rows += inception_rows(root, size)
            rows += [clean_resize_row(size), dinov2_row(root, size), *clip_rows(files, size), hps_row(files, size)]
    print(f"| {'metric':<32} | {'reference':<50} | {'px':>3} | {'agreement':>9} | {'step changed':>12} | unit")
    print(f"|{'-' * 34}|{'-' * 52}|{'-' * 5}|{'-' * 11}|{'-' * 14}|------")
    for r in rows:
        print(
            f"| {r['metric']:<32} | {r['reference']:<50} | {r['size']:>3} | {r['agreement']:>9.1e} | "
            f"{r['control']:>12.1e} | {r['unit']}; control: {r['control_step']}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
