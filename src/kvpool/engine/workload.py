"""The demo's workload: one long document, questions about it, and multi-turn follow-ups.

The text ships in ``kvpool/engine/data/`` (``document.md``, written for kvpool and
released as CC0; ``questions.json``). Every conversation starts with the same system
message and the document, so all conversations share the document's pages; a follow-up
repeats its conversation so far, so it shares that conversation's pages too.

This module is pure Python (no torch): it plans requests as chat messages; a worker
applies the chat template and tokenises.
"""

from __future__ import annotations

import dataclasses
import json
from importlib import resources

ENGINES = ("A", "B")


@dataclasses.dataclass
class PlannedRequest:
    """One request of the demo.

    Fields:
        engine: "A" or "B", the engine process that serves it.
        conversation: index of the conversation (= of its first question).
        turn: 0 for the question about the document, 1 for the follow-up.
        question: the user's new message in this turn.
        follows: index in the plan of the previous turn's request (None for turn 0).
    """

    engine: str
    conversation: int
    turn: int
    question: str
    follows: int | None = None


def load_workload() -> dict:
    """The shipped workload: {"document": str, "system": str, "questions": [...],
    "follow_ups": [{"question": int, "text": str}, ...]}."""
    data = resources.files("kvpool.engine") / "data"
    spec = json.loads((data / "questions.json").read_text(encoding="utf-8"))
    spec["document"] = (data / "document.md").read_text(encoding="utf-8")
    return spec


def plan_requests(workload: dict, questions: int) -> list[PlannedRequest]:
    """The demo's requests, in the order they run.

    The first half of the questions (rounded up) go to engine A, the rest to B; then
    each conversation that has a follow-up continues on the OTHER engine, so that the
    follow-up reuses pages the other process wrote, through the store.
    """
    questions = max(1, min(questions, len(workload["questions"])))
    first_b = (questions + 1) // 2
    plan = [PlannedRequest("A" if i < first_b else "B", i, 0, workload["questions"][i])
            for i in range(questions)]
    for follow in workload["follow_ups"]:
        conv = follow["question"]
        if conv < questions:
            other = "B" if plan[conv].engine == "A" else "A"
            plan.append(PlannedRequest(other, conv, 1, follow["text"], follows=conv))
    return plan


def first_user_message(workload: dict, question: str) -> str:
    """The first user turn: the document, then the question."""
    return f"Read this document.\n\n{workload['document']}\n\nQuestion: {question}"


def messages_for(workload: dict, plan: list[PlannedRequest], index: int,
                 answers: dict[int, str]) -> list[dict]:
    """Chat messages of request ``index``: system, document and question, and for a
    follow-up the previous answer (``answers[follows]``) and the new question."""
    req = plan[index]
    if req.follows is None:
        return [{"role": "system", "content": workload["system"]},
                {"role": "user", "content": first_user_message(workload, req.question)}]
    previous = messages_for(workload, plan, req.follows, answers)
    return previous + [{"role": "assistant", "content": answers[req.follows]},
                       {"role": "user", "content": req.question}]


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` under the tokenizer's chat template, ready for the
    assistant's answer (generation prompt added). The template already writes every
    special token, so none is added again."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
