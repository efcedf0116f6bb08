"""What a simulated request outputs: its natural length, its pseudo-words and its reasoning split.

A request is planned once when it arrives (`plan_output`): how long the model "wants" to talk and
where in a fixed pseudo-random word stream its words start. The plan is rendered only when the
request ends (`render`), for however many tokens it actually got, so a request cut by `length` or by
an abort shows exactly the prefix of what it would have said. Rendering slices precomputed lists, so
a 300-token answer costs a few list slices and one join, not 300 RNG calls.
"""
from __future__ import annotations

import functools
import hashlib
import math
import random
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from sglang_sim.config import (
    LEXICON_SIZE,
    THINK_CLOSE_ID,
    THINK_OPEN_ID,
    WORD_ID_BASE,
    ReasoningStyle,
    SimConfig,
)

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
# The word stream is this long; longer outputs wrap around it.
_STREAM_LEN = 1 << 15
# Text around the markers, as Qwen3 templates render them.
THINK_OPEN_TEXT = "<think>\n"
THINK_CLOSE_TEXT = "\n</think>\n\n"


class Lexicon:
    """A fixed vocabulary of pseudo-words and a long pseudo-random stream of them (ids and strings)."""

    def __init__(self, seed: int = 0) -> None:
        rng = random.Random(f"sglang-sim-lexicon:{seed}")
        words: list[str] = []
        seen: set[str] = set()
        while len(words) < LEXICON_SIZE:
            syllables = rng.choice((1, 2, 2, 3, 3, 4))
            w = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(syllables))
            if rng.random() < 0.08:
                w += rng.choice(".,")
            if w not in seen:
                seen.add(w)
                words.append(w)
        self.words = words
        idx = rng.choices(range(LEXICON_SIZE), k=_STREAM_LEN)
        self.stream_words = [words[i] for i in idx]
        self.stream_ids = [WORD_ID_BASE + i for i in idx]

    def take(self, offset: int, count: int) -> tuple[list[str], list[int]]:
        """`count` consecutive stream entries from `offset`, wrapping around the stream's end."""
        words: list[str] = []
        ids: list[int] = []
        pos = offset % _STREAM_LEN
        while count > 0:
            end = min(_STREAM_LEN, pos + count)
            words += self.stream_words[pos:end]
            ids += self.stream_ids[pos:end]
            count -= end - pos
            pos = 0
        return words, ids


@functools.lru_cache(maxsize=8)
def lexicon_for(seed: int) -> Lexicon:
    """The (read-only) lexicon of a seed, built once per process: building costs tens of ms."""
    return Lexicon(seed)


@dataclass(frozen=True)
class OutputPlan:
    """What a request would say if nothing cut it short.

    natural_len counts every token including the final EOS; reasoning_words is how many of the body's
    words come before `</think>`; offset is where its words start in the lexicon stream.
    """

    natural_len: int
    reasoning_words: int
    offset: int
    style: ReasoningStyle
    # With --tokenizer: the real ids of the whole body (EOS excluded), the EOS, and the tokenizer to decode them
    ids: tuple[int, ...] | None = None
    eos: int | None = None
    tokenizer: Any = field(default=None, compare=False, repr=False)

    def body_len(self) -> int:
        """Tokens before EOS."""
        return self.natural_len - 1


def request_rng(cfg: SimConfig, seq: int, input_digest: str, sampling_seed: int | None, greedy: bool) -> random.Random:
    """The RNG of one request.

    Without a sampling seed each request gets a fresh stream (server seed + arrival number), so a run
    is reproducible when requests arrive in the same order. With `sampling_seed`, or greedy decoding,
    identical requests repeat: the stream depends only on the server seed, the seed and the input.
    """
    if sampling_seed is not None or greedy:
        return random.Random(f"{cfg.seed}:s{sampling_seed}:{input_digest}")
    return random.Random(f"{cfg.seed}:n{seq}")


def input_digest(prompt: Sequence[int] | str) -> str:
    """A short stable digest of the prompt, to key deterministic (seeded or greedy) requests."""
    raw = prompt.encode() if isinstance(prompt, str) else repr(list(prompt)).encode()
    return hashlib.blake2b(raw, digest_size=8).hexdigest()


def draw_length(cfg: SimConfig, rng: random.Random) -> int:
    """A natural output length (EOS included, at least 1) from the configured distribution."""
    mean = cfg.mean_tokens
    if cfg.length_dist == "fixed":
        x = mean
    elif cfg.length_dist == "exponential":
        x = rng.expovariate(1.0 / mean)
    else:
        # Choose mu so the lognormal's mean (not its median) is mean_tokens.
        mu = math.log(mean) - cfg.sigma * cfg.sigma / 2.0
        x = rng.lognormvariate(mu, cfg.sigma)
    return max(1, int(round(x)))


def plan_output(cfg: SimConfig, rng: random.Random, min_new_tokens: int = 0) -> OutputPlan:
    """Draw a request's natural output; `min_new_tokens` holds the EOS back as SGLang does."""
    natural = max(draw_length(cfg, rng), min_new_tokens + 1)
    offset = rng.randrange(_STREAM_LEN)
    words = max(0, natural - 1 - _marker_count(cfg.reasoning_style))
    reasoning = int(round(cfg.reasoning_fraction * words)) if cfg.reasoning_style != "none" else 0
    return OutputPlan(natural_len=natural, reasoning_words=reasoning, offset=offset, style=cfg.reasoning_style)


def _marker_count(style: ReasoningStyle) -> int:
    return {"open": 1, "full": 2}.get(style, 0)


#: What opens an assistant turn in a rendered prompt: ChatML (Qwen, the demo tokenizer), GLM-4.5, harmony (gpt-oss).
ASSISTANT_HEADERS = ("<|im_start|>assistant", "<|assistant|>", "<|start|>assistant")


def earlier_assistant_turns(prompt_text: str) -> int:
    """The assistant turns a prompt holds before the one it asks for (its generation prompt is one more header)."""
    return max(0, max(prompt_text.count(h) for h in ASSISTANT_HEADERS) - 1)


def text_length_scale(cfg: SimConfig, prompt_text: str) -> float:
    """--length-scale-by-text: the factor of the first TEXT the prompt contains, 1 when none does."""
    return next((f for text, f in cfg.length_scale_by_text if text in prompt_text), 1.0)


def plan_with_tokenizer(cfg: SimConfig, lexicon: Lexicon, plan: OutputPlan, rng: random.Random, tok: Any,
                        prompt: Sequence[int] | Sequence[str]) -> OutputPlan:
    """The plan's text in its family's format (sglang_sim/families.py), tokenized: about the drawn length (the
    words are chosen for it), exactly the tokenized length plus the EOS."""
    from sglang_sim.families import family_text, find_call
    style = {"open": "qwen3-thinking", "full": "qwen3"}.get(plan.style, plan.style)
    prompt_text = (tok.decode(prompt, skip_special_tokens=False) if prompt and isinstance(prompt[0], int)
                   else " ".join(str(p) for p in prompt))
    scale = text_length_scale(cfg, prompt_text)
    if cfg.turn_length_scale:  # the conversation's turn k answers with lengths of their own (--turn-length-scale)
        scale *= cfg.turn_length_scale[min(earlier_assistant_turns(prompt_text), len(cfg.turn_length_scale) - 1)]
    n_words = max(2, round(plan.body_len() * scale / tok.tokens_per_word))
    n_reason = 0 if style in ("none", "deepseek-v3") else int(round(cfg.reasoning_fraction * n_words))
    words, _ = lexicon.take(plan.offset, n_words)
    reasoning, answer = " ".join(words[:n_reason]), " ".join(words[n_reason:])
    call = find_call(prompt_text, words[n_reason:], rng.random() < 0.5)
    text = answer if style == "none" and call is None else family_text(
        "qwen3-thinking" if style == "none" else style, reasoning, answer, call)
    ids = tok.encode(text)
    return replace(plan, natural_len=len(ids) + 1, reasoning_words=n_reason, ids=tuple(ids),
                   eos=tok.eos_for(style, call is not None), tokenizer=tok)


def render(lexicon: Lexicon, plan: OutputPlan, n_tokens: int, eos_id: int | None,
           skip_special_tokens: bool = True) -> tuple[str, list[int]]:
    """Text and output_ids of the first `n_tokens` body tokens, plus `eos_id` when given.

    With a tokenizer (``plan.ids``) the ids are a prefix of the planned ones, the EOS is the family's
    (``plan.eos``) and the text is their decode, special tokens kept only when ``skip_special_tokens`` is false.

    The body is `[<think>] reasoning-words </think> answer-words` (markers per style); a cut inside
    the reasoning therefore has no `</think>`. EOS is a special token: it ends output_ids but never
    appears in the text, as with skip_special_tokens=true.
    """
    if plan.ids is not None:
        body = list(plan.ids[:n_tokens])
        text = plan.tokenizer.decode(body, skip_special_tokens=skip_special_tokens)
        return text, body + ([plan.eos if plan.eos is not None else eos_id] if eos_id is not None else [])
    left = n_tokens
    opened = plan.style == "full" and left > 0
    left -= opened
    n_reason = min(left, plan.reasoning_words)
    left -= n_reason
    closed = plan.style != "none" and left > 0
    left -= closed
    n_answer = left
    words, ids = lexicon.take(plan.offset, n_reason + n_answer)
    parts: list[str] = []
    out_ids: list[int] = []
    if opened:
        parts.append(THINK_OPEN_TEXT)
        out_ids.append(THINK_OPEN_ID)
    parts.append(" ".join(words[:n_reason]))
    out_ids += ids[:n_reason]
    if closed:
        parts.append(THINK_CLOSE_TEXT)
        out_ids.append(THINK_CLOSE_ID)
    parts.append(" ".join(words[n_reason:]))
    out_ids += ids[n_reason:]
    if eos_id is not None:
        out_ids.append(eos_id)
    return "".join(parts), out_ids


def pseudo_tokenize(text: str) -> list[str]:
    """Stand-in tokenizer for `text` prompts: one token per whitespace-separated word."""
    return text.split()
