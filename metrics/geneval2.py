"""GenEval 2 (Kamath et al. 2025, arXiv 2512.16853) scored with Soft-TIFA: a vision-language judge answers one
question per prompt atom, an atom's score is the judge's probability of the right answer, a prompt's score the
geometric mean of its atoms' (formulas in :mod:`lightning_muon.metrics.functional`).

The reference (facebookresearch/GenEval2 ``evaluation.py``) asks Qwen3-VL-8B-Instruct each question followed by
"Answer in one word." in a single user turn after the image, reads the next-token distribution of the assistant's
first token, and sums the probabilities of the answer's spellings: for "How many …" questions the number word, its
capitalized form, both with a leading space, and its digits with and without one; for the others "Yes" / "yes"
with and without a leading space. Here an answer's spellings are its distinct first tokens that are whole
spellings (a spelling the tokenizer splits, e.g. "10" into "1" "0", cannot be read from one distribution and is
left out).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torchmetrics import Metric

from lightning_muon.metrics.functional import GENEVAL2_SKILLS, soft_tifa_from_sums, soft_tifa_sums
from lightning_muon.metrics.images import check_images, to_uint8

__all__ = ["GenEval2", "GenEval2Prompt", "SoftTifaJudge", "answer_spellings", "load_geneval2"]

#: the reference's judge (a local directory or cached hub id; nothing is downloaded)
DEFAULT_JUDGE = "Qwen/Qwen3-VL-8B-Instruct"
NUMBERS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
QUESTION_SUFFIX = " Answer in one word."


@dataclass(frozen=True)
class GenEval2Prompt:
    """One benchmark line: the prompt, its atomicity, and one (question, answer, skill) per atom."""

    prompt: str
    atom_count: int
    questions: tuple[str, ...]
    answers: tuple[str, ...]
    skills: tuple[str, ...]


def load_geneval2(path: str | os.PathLike) -> list[GenEval2Prompt]:
    """The reference's ``geneval2_data.jsonl`` (one JSON object per line: ``prompt``, ``atom_count``, ``vqa_list``
    of ``[question, answer]`` pairs, ``skills``), checked line by line.

    Raises:
        FileNotFoundError: no such file.
        ValueError: naming the line and the field that does not fit the schema.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"GenEval 2 benchmark {str(path)!r} does not exist: pass geneval2_prompts= the reference's "
            "geneval2_data.jsonl (github.com/facebookresearch/GenEval2; it is not shipped here)."
        )
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            prompts.append(_record(f"{path}:{number}", line))
    if not prompts:
        raise ValueError(f"GenEval 2 benchmark {path} has no prompts.")
    return prompts


def _record(where: str, line: str) -> GenEval2Prompt:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where} is not JSON ({err.msg}).") from None

    def fail(field: str, expected: str) -> ValueError:
        value = row.get(field) if isinstance(row, dict) else row
        return ValueError(f"{where}: {field} must be {expected}, got {value!r:.200}.")

    if not isinstance(row, dict):
        raise fail("the line", "a JSON object")
    if not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
        raise fail("prompt", "a non-empty string")
    count = row.get("atom_count")
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= 64:
        raise fail("atom_count", "an integer in [1, 64]")
    pairs = row.get("vqa_list")
    if not isinstance(pairs, list) or not pairs or not all(_is_pair(p) for p in pairs):
        raise fail("vqa_list", "a non-empty list of [question, answer] string pairs")
    skills = row.get("skills")
    if not isinstance(skills, list) or len(skills) != len(pairs) or not all(s in GENEVAL2_SKILLS for s in skills):
        raise fail("skills", f"one of {GENEVAL2_SKILLS} per vqa_list pair ({len(pairs)})")
    for question, answer in pairs:
        if question.startswith("How many") and answer.lower() not in NUMBERS:
            raise fail("vqa_list", f"a number word {NUMBERS} as the answer of {question!r}")
    return GenEval2Prompt(row["prompt"], count, tuple(q for q, _ in pairs), tuple(a for _, a in pairs), tuple(skills))


def _is_pair(pair: object) -> bool:
    return isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) and x.strip() for x in pair)


def answer_spellings(question: str, answer: str) -> list[str]:
    """The spellings of a right answer whose probabilities the reference adds up."""
    if question.startswith("How many"):
        word = answer.lower()
        digits = str(NUMBERS.index(word) + 1)
        return [word, word.capitalize(), " " + word, " " + word.capitalize(), digits, " " + digits]
    return [answer.capitalize(), answer.lower(), " " + answer.lower(), " " + answer.capitalize()]


class SoftTifaJudge(nn.Module):
    """A transformers vision-language model (``AutoModelForImageTextToText`` and its ``AutoProcessor``) as Soft-TIFA's
    judge: :meth:`answer_probabilities` asks one question about one image per chat, batched with left padding.

    Args:
        weights: a local directory or a cached hub id (default: the reference's Qwen3-VL-8B-Instruct).
        dtype: the judge's weights, loaded directly in it; default bf16 where CUDA is available (an 8B judge is
            ~17 GB there, twice that in float32), else float32.
        batch_size: (image, question) chats per forward pass.
    """

    def __init__(
        self, weights: str | os.PathLike = DEFAULT_JUDGE, dtype: torch.dtype | None = None, batch_size: int = 16
    ) -> None:
        super().__init__()
        from transformers import AutoModelForImageTextToText, AutoProcessor

        dtype = dtype or (torch.bfloat16 if torch.cuda.is_available() else torch.float32)
        try:
            self.processor = AutoProcessor.from_pretrained(str(weights), local_files_only=True)
            self.model = AutoModelForImageTextToText.from_pretrained(
                str(weights), local_files_only=True, torch_dtype=dtype
            )
        except OSError as err:
            raise FileNotFoundError(
                f"GenEval 2 judge not found at {str(weights)!r}: neither a local directory nor a cached hub id (this "
                "library never downloads). Pass geneval2_judge= a directory made with `huggingface-cli download "
                f"{DEFAULT_JUDGE} --local-dir DIR` on a machine online."
            ) from err
        self.processor.tokenizer.padding_side = "left"  # the next token of every chat is at the last position
        self.model.eval().requires_grad_(False)
        self.batch_size = batch_size
        self.weights = str(weights)

    def answer_ids(self, question: str, answer: str) -> list[int]:
        """The distinct token ids of the answer's one-token spellings."""
        ids = (self.processor.tokenizer.encode(s, add_special_tokens=False) for s in answer_spellings(question, answer))
        return sorted({i[0] for i in ids if len(i) == 1})

    def chat(self, question: str) -> str:
        """The judge's prompt text for one question (the image placeholder, then the question)."""
        content = [{"type": "image"}, {"type": "text", "text": question + QUESTION_SUFFIX}]
        return self.processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )

    @torch.no_grad()
    def answer_probabilities(
        self, images: Sequence[Tensor], questions: Sequence[str], answers: Sequence[str]
    ) -> Tensor:
        """P(right answer) for each (image, question, answer) triple, float32 ``(N,)``: the softmax of the first
        generated token's logits summed over :meth:`answer_ids`."""
        from PIL import Image

        first = next(self.model.parameters())
        out = []
        for start in range(0, len(questions), self.batch_size):
            part = slice(start, start + self.batch_size)
            pictures = [Image.fromarray(to_uint8(x[None])[0].permute(1, 2, 0).cpu().numpy()) for x in images[part]]
            batch = self.processor(
                text=[self.chat(q) for q in questions[part]], images=pictures, padding=True, return_tensors="pt"
            ).to(first.device)
            batch["pixel_values"] = batch["pixel_values"].to(first.dtype)
            probs = self.model(**batch).logits[:, -1].float().softmax(-1)
            for row, question, answer in zip(probs, questions[part], answers[part]):
                out.append(row[self.answer_ids(question, answer)].sum())
        return torch.stack(out) if out else torch.zeros(0, device=first.device)


class GenEval2(Metric):
    """GenEval 2 with Soft-TIFA (see the module docstring): :meth:`update` takes generated images and the index of
    the benchmark prompt each was generated for; ``compute()`` returns the benchmark score ``geneval2`` (mean
    Soft-TIFA GM, percent), ``geneval2_am``, ``geneval2_skill_<skill>`` and ``geneval2_atoms_<n>``
    (:func:`~lightning_muon.metrics.functional.soft_tifa_from_sums`). States are float64 sums reduced over DDP
    ranks; a rank without images contributes zeros.

    Args:
        benchmark: the reference's ``geneval2_data.jsonl`` (:func:`load_geneval2`).
        judge: the judge's weights (:class:`SoftTifaJudge`), or a judge.
        images_per_prompt: images generated per prompt (the reference maps each prompt to one image).
        kwargs: torchmetrics ``Metric`` options.
    """

    higher_is_better = True
    full_state_update = False

    def __init__(
        self,
        benchmark: str | os.PathLike,
        judge: str | os.PathLike | SoftTifaJudge = DEFAULT_JUDGE,
        images_per_prompt: int = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if images_per_prompt < 1:
            raise ValueError(f"images_per_prompt must be >= 1, got {images_per_prompt}.")
        self.prompts = load_geneval2(benchmark)
        self.judge = judge if isinstance(judge, SoftTifaJudge) else SoftTifaJudge(judge)
        self.images_per_prompt = images_per_prompt
        self.num_atom_counts = max(p.atom_count for p in self.prompts) + 1
        skills, atoms = len(GENEVAL2_SKILLS), self.num_atom_counts
        shapes = dict(gm=(), am=(), images=(), skill_sum=(skills,), skill_count=(skills,))
        shapes.update(atoms_gm=(atoms,), atoms_count=(atoms,))  # the sums of soft_tifa_sums
        for name, shape in shapes.items():
            self.add_state(name, torch.zeros(shape, dtype=torch.float64), dist_reduce_fx="sum")
        self.sum_names = tuple(shapes)

    @property
    def num_samples(self) -> int:
        """Images one evaluation generates: every prompt ``images_per_prompt`` times."""
        return len(self.prompts) * self.images_per_prompt

    def prompt_of(self, sample: int) -> GenEval2Prompt:
        """The prompt of global sample ``sample`` (samples ``k·images_per_prompt …`` are prompt k's)."""
        return self.prompts[sample // self.images_per_prompt]

    def atom_probabilities(self, images: Tensor, samples: Sequence[int]) -> list[Tensor]:
        """Each image's atom probabilities, the judge batched over all (image, atom) pairs of the batch."""
        check_images(images)
        prompts = [self.prompt_of(int(s)) for s in samples]
        if len(prompts) != len(images):
            raise ValueError(f"Got {len(images)} images but {len(prompts)} sample indices; pass one per image.")
        owner = [i for i, p in enumerate(prompts) for _ in p.questions]
        probs = self.judge.answer_probabilities(
            [images[i] for i in owner],
            [q for p in prompts for q in p.questions],
            [a for p in prompts for a in p.answers],
        )
        return list(probs.split([len(p.questions) for p in prompts]))

    def update(self, images: Tensor, samples: Tensor | Sequence[int]) -> None:
        """Score generated images; ``samples`` are their global sample indices (see :meth:`prompt_of`)."""
        samples = [int(s) for s in samples]
        for sample, p in zip(samples, self.atom_probabilities(images, samples)):
            prompt = self.prompt_of(sample)
            skills = torch.tensor([GENEVAL2_SKILLS.index(s) for s in prompt.skills], device=p.device)
            sums = soft_tifa_sums(p, skills, prompt.atom_count, self.num_atom_counts)
            for name, value in sums.items():
                setattr(self, name, getattr(self, name) + value.to(self.device))

    def compute(self) -> dict[str, Tensor]:
        sums = {name: getattr(self, name) for name in self.sum_names}
        return {k: v.float() for k, v in soft_tifa_from_sums(sums).items()}
