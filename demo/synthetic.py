"""Synthetic datasets for tests and benchmarks: N short prompts, N three-turn conversations. Each is the same on
every run (made from its index, no randomness), so a run's outputs can be checked against its inputs."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Final

WORDS: Final = ("alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone cloud field "
                "metal paper glass light sound water").split()
SYSTEM: Final = "You are a careful assistant. Answer the user's questions one by one, and keep to the point."
#: In every dataset answer: none of the dataset's answers is ever sent, so none may reach a prompt.
DATASET_MARK: Final = "Dataset-answer"
#: The reasoning parser for these conversations: the demo tokenizer without thinking (produce's auto detection
#: says none too).
CONVERSATIONS_PARSER: Final = "none"


def write_prompts(path: Path, n: int, prefix: str = "Write item", system: str | None = None) -> Path:
    """A synthetic dataset of n short prompts (optionally sharing a long system prompt)."""
    with open(path, "w") as fh:
        for i in range(n):
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": f"{prefix} {i}: explain step {i % 97} of the plan."}]
            fh.write(json.dumps({"id": i, "messages": messages}) + "\n")
    return path


def conversation(c: int, context_words: int) -> list[dict[str, str]]:
    """One 3-turn conversation: system, u1 (with ``context_words`` words of its own), a1, u2, a2, u3."""
    own = " ".join(f"{WORDS[(c * 7 + i * 3) % len(WORDS)]}{(c * 31 + i) % 1000}" for i in range(context_words))
    answer = [f"{DATASET_MARK} {t} of conversation {c}: " + " ".join(WORDS[(c + t + i) % len(WORDS)] for i in range(40))
              for t in (1, 2)]
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Conversation {c}. {own} Explain step {c % 97} of the plan."},
            {"role": "assistant", "content": answer[0]},
            {"role": "user", "content": f"Follow-up 1 of {c}: go on with the next point."},
            {"role": "assistant", "content": answer[1]},
            {"role": "user", "content": f"Follow-up 2 of {c}: and how does it end?"}]


def write_conversations(path: Path, n: int, context_words: int = 0) -> Path:
    """N conversations (`conversation`), ids c00000, c00001, ...: produce ``--turns all`` regenerates their
    three assistant turns."""
    with open(path, "w") as fh:
        for c in range(n):
            fh.write(json.dumps({"id": f"c{c:05d}", "messages": conversation(c, context_words)}) + "\n")
    return path
