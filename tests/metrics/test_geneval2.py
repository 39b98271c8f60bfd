"""GenEval 2 with Soft-TIFA against an independent computation: the judge called the plain transformers way (one
image, one question, the processor's own chat-template tokenization), the reference's answer spellings, and the
reference's aggregation written with scipy's ``gmean``; a 2-rank DDP run with an empty rank; the schema errors."""

import json

import numpy as np
import pytest
import torch
from dist_workers import geneval2_worker
from fixtures import GENEVAL2_ROWS, geneval2_benchmark, tiny_vlm_judge
from helpers import run_distributed
from metric_references import reference_probability, reference_report

from lightning_muon.metrics.geneval2 import GenEval2, load_geneval2


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("geneval2")
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (4, 3, 24, 32), dtype=torch.uint8, generator=g)
    images[3] = images[3, :1].expand(3, -1, -1)  # one grey image
    return {
        "judge": tiny_vlm_judge(root / "judge"),
        "benchmark": geneval2_benchmark(root / "geneval2_data.jsonl"),
        "images": images,
        "samples": [0, 1, 2, 1],  # prompt 1 twice
    }


@pytest.fixture(scope="module")
def reference(assets):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(str(assets["judge"]), local_files_only=True)
    model = AutoModelForImageTextToText.from_pretrained(str(assets["judge"]), local_files_only=True).eval()
    rows = [GENEVAL2_ROWS[s] for s in assets["samples"]]
    scores = [
        [reference_probability(model, processor, image, q, a) for q, a in row["vqa_list"]]
        for image, row in zip(assets["images"], rows)
    ]
    return scores, rows


def test_atom_probabilities_and_report_equal_an_independent_computation(assets, reference):
    scores, rows = reference
    metric = GenEval2(assets["benchmark"], assets["judge"])
    metric.judge.batch_size = 5  # chats of different lengths share a batch (left padding)
    ours = metric.atom_probabilities(assets["images"], assets["samples"])
    for mine, theirs in zip(ours, scores):
        np.testing.assert_allclose(mine.numpy(), theirs, rtol=1e-4, atol=1e-7)
    flat = np.concatenate([np.asarray(s) for s in scores])
    assert flat.std() > 0.1 * flat.mean()  # the tiny judge discriminates: equal numbers are not an accident
    metric.update(assets["images"], assets["samples"])
    report = {k: float(v) for k, v in metric.compute().items()}
    expected = reference_report(scores, rows)
    assert report.keys() == expected.keys()
    for key, value in expected.items():
        assert report[key] == pytest.approx(value, rel=1e-5), key
    # break controls: an arithmetic mean in place of the geometric one, or right padding read at the last position
    assert abs(100 * np.mean([np.mean(s) for s in scores]) - expected["geneval2"]) > 1e-3 * expected["geneval2"]
    metric.judge.processor.tokenizer.padding_side = "right"
    wrong = torch.cat(metric.atom_probabilities(assets["images"], assets["samples"]))
    assert not np.allclose(wrong.numpy(), flat, rtol=1e-2)


@pytest.mark.distributed
def test_ddp_with_an_empty_rank_equals_one_process(assets):
    single = geneval2_worker(0, 1, assets["benchmark"], assets["judge"], assets["images"], assets["samples"])
    args = (assets["benchmark"], assets["judge"], assets["images"], assets["samples"])
    for values in run_distributed(geneval2_worker, 2, *args):
        assert values == pytest.approx(single, rel=1e-9)


def test_missing_judge_weights_name_the_argument(tmp_path, assets):
    with pytest.raises(FileNotFoundError, match="geneval2_judge="):
        GenEval2(assets["benchmark"], tmp_path / "no-judge")
    with pytest.raises(FileNotFoundError, match="geneval2_prompts="):
        GenEval2(tmp_path / "missing.jsonl", assets["judge"])


def edit(field, value):
    row = json.loads(json.dumps(GENEVAL2_ROWS[0]))
    if value is None:
        row.pop(field)
    else:
        row[field] = value
    return json.dumps(row)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "is not JSON"),
        ("[1, 2]", "a JSON object"),
        (edit("prompt", None), "prompt must be a non-empty string"),
        (edit("prompt", " "), "prompt must be a non-empty string"),
        (edit("atom_count", "3"), "atom_count must be an integer"),
        (edit("atom_count", 0), "atom_count must be an integer"),
        (edit("vqa_list", []), "vqa_list must be a non-empty list"),
        (edit("vqa_list", [["Is it red?"]]), "vqa_list must be a non-empty list"),
        (edit("vqa_list", [["How many cats are there?", "many"]] * 3), "number word"),
        (edit("skills", ["count", "attribute"]), "skills must be one of"),
        (edit("skills", ["count", "colour", "object"]), "skills must be one of"),
    ],
)
def test_schema_errors_name_the_line_and_field(tmp_path, line, message):
    path = geneval2_benchmark(tmp_path / "b.jsonl")
    assert len(load_geneval2(path)) == 3  # control: the well-formed file loads
    path.write_text(path.read_text() + line + "\n")
    with pytest.raises(ValueError, match=rf"b.jsonl:4: .*{message}|b.jsonl:4 {message}"):
        load_geneval2(path)


def test_evaluate_without_the_benchmark_is_a_short_error(tmp_path, capsys, assets):
    from lightning_muon.recipes.evaluate import main as evaluate

    with pytest.raises(SystemExit) as exit_info:
        evaluate([str(tmp_path), "--metrics", "geneval2", "--geneval2-judge", str(assets["judge"])])
    assert exit_info.value.code == 2 and "needs `geneval2_prompts=`" in capsys.readouterr().err


def test_the_judge_loads_in_bf16_where_cuda_is(monkeypatch, assets):
    """Where CUDA is available the judge's weights are read in bf16 directly (an 8B judge: ~17 GB, not ~35 GB in
    float32 cast later); an explicit dtype wins. Control: on a CPU-only machine, float32."""
    from lightning_muon.metrics.geneval2 import SoftTifaJudge

    def dtypes(judge):
        return {p.dtype for p in judge.model.parameters()}

    assert dtypes(SoftTifaJudge(assets["judge"])) == {torch.float32}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert dtypes(SoftTifaJudge(assets["judge"])) == {torch.bfloat16}
    assert dtypes(SoftTifaJudge(assets["judge"], dtype=torch.float32)) == {torch.float32}
