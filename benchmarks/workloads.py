"""Workloads: Spec-Bench questions rendered into token ids with the model's chat template,
two-turn conversations, and image prompts for the tiny vision-language model.

Everything here is plain data (token ids, texts, image seeds) so that a job can travel to a
worker process as JSON.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SPEC_BENCH = Path(__file__).parent / "data" / "spec_bench" / "question.jsonl"
# Every engine's warm-up request: outside every measured set, so no method starts a timed run
# with a measured answer already in its caches (suffix decoding's global tree, RECAP's shared
# index).
WARMUP_TEXT = "Hello! Introduce yourself in one sentence."


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: where it came from and its token ids."""

    prompt_id: str
    category: str
    token_ids: list[int]

    def to_dict(self) -> dict:
        return {"prompt_id": self.prompt_id, "category": self.category, "token_ids": self.token_ids}


def load_spec_bench(
    path: str | Path = SPEC_BENCH,
    per_category: int | None = None,
    categories: list[str] | None = None,
) -> list[dict]:
    """Rows of a Spec-Bench-format JSONL file, the first ``per_category`` of each category.

    Categories keep the file's order; ``categories`` restricts and must name existing ones.
    """
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    known = _categories(rows, categories, "Spec-Bench categories")
    picked = []
    for cat in known:
        in_cat = [r for r in rows if r["category"] == cat]
        picked.extend(in_cat[:per_category] if per_category else in_cat)
    return picked


def _categories(rows: list[dict], wanted: list[str] | None, what: str) -> list[str]:
    """The rows' categories in file order, restricted to ``wanted`` (which must all exist)."""
    known = list(dict.fromkeys(r["category"] for r in rows))
    if not wanted:
        return known
    unknown = sorted(set(wanted) - set(known))
    if unknown:
        raise ValueError(f"Unknown {what} {unknown}; the file has {known}.")
    return [c for c in known if c in wanted]


def render(tokenizer, user_turns: list[str], assistant_turns: list[str] = ()) -> list[int]:
    """Token ids of a conversation ready for the next assistant turn.

    Uses the tokenizer's chat template when it has one (instruct models); a base model without
    one gets the plain concatenated text.
    """
    if tokenizer.chat_template:
        messages = []
        for i, user in enumerate(user_turns):
            messages.append({"role": "user", "content": user})
            if i < len(assistant_turns):
                messages.append({"role": "assistant", "content": assistant_turns[i]})
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"])
    parts: list[str] = []
    for i, user in enumerate(user_turns):
        parts.append(user)
        if i < len(assistant_turns):
            parts.append(assistant_turns[i])
    return tokenizer("\n\n".join(parts) + "\n\n")["input_ids"]


def spec_bench_prompts(tokenizer, per_category: int, categories: list[str] | None = None,
                       path: str | Path = SPEC_BENCH, max_prompt_tokens: int | None = None) -> list[Prompt]:
    """First-turn Spec-Bench prompts, tokenized; prompts longer than max_prompt_tokens are skipped."""
    out = []
    for row in load_spec_bench(path, None, categories):
        ids = render(tokenizer, [row["turns"][0]])
        if max_prompt_tokens and len(ids) > max_prompt_tokens:
            continue
        if sum(p.category == row["category"] for p in out) >= per_category:
            continue
        out.append(Prompt(f"sb{row['question_id']}", row["category"], ids))
    return out


def first_spec_bench_prompts(tokenizer, n: int) -> list[Prompt]:
    """The first ``n`` Spec-Bench prompts of ``ceil(n / 13)`` per category, in the file's
    category order (13: one per category, 26: two)."""
    return spec_bench_prompts(tokenizer, -(-n // 13))[:n]  # Spec-Bench has 13 categories


def two_turn_conversations(tokenizer, per_category: int, categories: list[str] | None = None,
                           path: str | Path = SPEC_BENCH) -> list[dict]:
    """Spec-Bench rows with two turns (MT-bench), first ``per_category`` of each category.

    Returns dicts with ``prompt_id``, ``category``, ``turns`` (the two user texts) and
    ``turn1_ids`` (the first turn rendered); the second turn is rendered by the worker once
    the first answer exists (``render_turn2``).
    """
    rows = [r for r in load_spec_bench(path) if len(r["turns"]) >= 2]
    known = _categories(rows, categories, "two-turn categories")
    out = []
    for cat in known:
        for row in [r for r in rows if r["category"] == cat][:per_category]:
            out.append({"prompt_id": f"sb{row['question_id']}", "category": cat,
                        "turns": row["turns"][:2], "turn1_ids": render(tokenizer, row["turns"][:1])})
    return out


def render_turn2(tokenizer, turns: list[str], answer: str) -> list[int]:
    """Token ids of the second turn: user 1, the first answer, user 2 (chat template)."""
    return render(tokenizer, turns[:2], [answer])


# Image prompts for the multimodal workload: (question, image size (h, w)); the image of item i
# is tests/images.make_image(i, size). Sizes differ so image token counts differ.
MULTIMODAL_ITEMS: list[tuple[str, tuple[int, int]]] = [
    ("Describe this picture.", (64, 80)),
    ("What colour dominates?", (112, 56)),
    ("Count the shapes, then list them.", (56, 56)),
    ("Is it day or night? Explain.", (84, 140)),
    ("Write a caption for this image.", (96, 96)),
    ("What is in the top left corner?", (70, 112)),
]


def multimodal_items(n: int) -> list[dict]:
    """The first ``n`` image prompts as plain data (question, image seed and size)."""
    if n > len(MULTIMODAL_ITEMS):
        raise ValueError(f"at most {len(MULTIMODAL_ITEMS)} multimodal prompts are defined, asked {n}")
    return [{"prompt_id": f"mm{i}", "category": "image", "question": q, "image_seed": i,
             "image_size": list(size)} for i, (q, size) in enumerate(MULTIMODAL_ITEMS[:n])]
