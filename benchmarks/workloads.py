"""Workloads: Spec-Bench questions rendered into token ids with the model's chat template."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SPEC_BENCH = Path(__file__).parent / "data" / "spec_bench" / "question.jsonl"


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: where it came from and its token ids."""

    prompt_id: str
    category: str
    token_ids: list[int]


def load_spec_bench(
    path: str | Path = SPEC_BENCH,
    per_category: int | None = None,
    categories: list[str] | None = None,
) -> list[dict]:
    """Rows of a Spec-Bench-format JSONL file, the first ``per_category`` of each category.

    Categories keep the file's order; ``categories`` restricts and must name existing ones.
    """
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    known = list(dict.fromkeys(r["category"] for r in rows))
    if categories:
        unknown = sorted(set(categories) - set(known))
        if unknown:
            raise ValueError(f"Unknown Spec-Bench categories {unknown}; the file has {known}.")
        known = [c for c in known if c in categories]
    picked = []
    for cat in known:
        in_cat = [r for r in rows if r["category"] == cat]
        picked.extend(in_cat[:per_category] if per_category else in_cat)
    return picked


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
