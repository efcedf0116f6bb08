"""A family's end-of-turn special tokens never reach a parsed field (issue 25): with ``skip_special_tokens`` false
the text SGLang returns keeps every special token but the stop token it matched, and the worker leaves the
family's end-of-turn tokens (worker/reasoning.py END_OF_TURN_TOKENS) out of ``reasoning`` and ``content``, while
``response`` and ``output_ids`` stay as the server sent them. Checked per family with its test tokenizer
(tests/families.py): the list is the tokenizer's stop tokens and the template's end of turn, none of them a marker
the parser reads."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from budget.record import ChunkPayload, SamplePayload
from producer.export.writer import ExportOptions, export_dataset
from producer.settings import PARSER_TEXT_MARKERS, special_markers
from render.chat import Renderer, load_tokenizer
from tests.exports import write_dataset
from tests.families import FAMILIES, build_family_tokenizer
from worker.reasoning import END_OF_TURN_TOKENS, parse_turn
from worker.sglang import Generation, result_record

PROMPT = [{"role": "user", "content": "What is the weather in Paris?"}]
ANSWER = "It is sunny."


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("families")
    return {family: load_tokenizer(build_family_tokenizer(root / family, family)) for family in FAMILIES}


def _special(tok: Any) -> set[str]:
    out = {str(t) for t in tok.all_special_tokens}
    return out | {str(t.content) for t in tok.added_tokens_decoder.values() if t.special}


def _stop_tokens(tok: Any) -> set[str]:
    """The tokenizer's EOS and the other stop ids of its generation_config.json (the server stops on them)."""
    stops = {str(tok.eos_token)}
    config = Path(tok.name_or_path) / "generation_config.json"
    if config.is_file():
        stops |= {str(tok.convert_ids_to_tokens(i)) for i in json.loads(config.read_text())["eos_token_id"]}
    return stops


def _answer_text(tok: Any, family: str) -> tuple[str, bool]:
    """What the model writes for a reasoned answer, as the family's template renders it, up to the answer's end
    (the template's own end of turn cut off)."""
    rendered = Renderer(tok).render(PROMPT)
    prompt = tok.decode(rendered.input_ids, skip_special_tokens=False)
    whole = tok.apply_chat_template([*PROMPT, {"role": "assistant", "content": ANSWER, "reasoning_content": "Easy."}],
                                    tokenize=False)
    assert whole.startswith(prompt) and ANSWER in whole, family
    return whole[len(prompt):whole.rindex(ANSWER) + len(ANSWER)], rendered.opens_think


@pytest.mark.parametrize("family", FAMILIES)
def test_the_end_tokens_are_the_familys_stops_and_end_of_turn_and_no_marker(tokenizers: dict[str, Any],
                                                                           family: str) -> None:
    tok = tokenizers[family]
    ends, markers = set(END_OF_TURN_TOKENS[family]), set(PARSER_TEXT_MARKERS[family])
    assert not ends & markers, family
    vocab = tok.get_vocab()
    assert all(t in _special(tok) for t in ends if t in vocab), family  # special: skip_special_tokens deletes them
    assert _stop_tokens(tok) <= ends | markers, family  # harmony's <|return|>, <|call|> are gpt-oss markers
    whole = tok.apply_chat_template([*PROMPT, {"role": "assistant", "content": ANSWER}], tokenize=False)
    after = whole[whole.rindex(ANSWER) + len(ANSWER):]
    first = min(((after.index(t), t) for t in _special(tok) if t in after), default=None)
    assert first is None or first[1] in ends | markers, (family, after)


@pytest.mark.parametrize("family", FAMILIES)
def test_an_end_token_the_model_wrote_is_left_out_of_the_parsed_fields(tokenizers: dict[str, Any],
                                                                      family: str) -> None:
    """Written at the end of the answer, or inside it (a stop id the server did not stop on): the fields are those
    of the text without it; with skip_special_tokens true the same string is text the model wrote, and kept."""
    tok = tokenizers[family]
    text, opens = _answer_text(tok, family)
    body = tok(text, add_special_tokens=False).input_ids
    plain = parse_turn(family, text, opens_think=opens, finish_reason="stop", call_id_seed="s")
    present = [t for t in END_OF_TURN_TOKENS[family] if t in tok.get_vocab()]
    assert present, family
    for end in present:
        end_id = tok.convert_tokens_to_ids(end)
        for ids in ([*body, end_id], [*body, end_id, end_id], [*body[:-2], end_id, *body[-2:]]):
            generated = tok.decode(ids, skip_special_tokens=False)
            assert end in generated
            got = parse_turn(family, generated, opens_think=opens, finish_reason="stop", call_id_seed="s",
                             special_tokens=True)
            assert end not in (got.reasoning or "") + got.content, (family, end, got)
            if ids[-1] == end_id:
                assert got == plain, (family, end)
        literal = parse_turn(family, text + end, opens_think=opens, finish_reason="stop", call_id_seed="s")
        assert end in (literal.reasoning or "") + literal.content, (family, end)


def _record(family: str, text: str, output_ids: list[int], skip: bool, *, sid: str = "s0",
            prompt: list[int] | None = None) -> dict[str, Any]:
    """The record a worker commits for this generation (worker/sglang.py result_record)."""
    chunk: ChunkPayload = {"v": 4, "dataset": "d", "chunk": "c", "think": None, "reasoning_parser": family,
                           "sampling_params": {"max_new_tokens": 64, "skip_special_tokens": skip}, "samples": []}
    prompt = [1, 2, 3] if prompt is None else prompt
    sample: SamplePayload = {"id": sid, "input_ids": prompt, "opens_think": False}
    gen = Generation(text=text, completion_tokens=len(output_ids), prompt_tokens=len(prompt), cached_tokens=0,
                     finish_reason="stop", server="http://sglang", output_ids=output_ids)
    return result_record("d", sample, gen, chunk)


@pytest.mark.parametrize("family", ["qwen3", "kimi_k2", "glm45", "deepseek-v3"])
def test_the_record_keeps_the_response_and_ids_and_parses_without_the_end(tokenizers: dict[str, Any],
                                                                         family: str) -> None:
    tok = tokenizers[family]
    end = END_OF_TURN_TOKENS[family][0]
    ids = [*tok(ANSWER, add_special_tokens=False).input_ids, tok.convert_tokens_to_ids(end)]
    text = tok.decode(ids, skip_special_tokens=False)
    turn = _record(family, text, ids, skip=False)["turns"][0]
    assert (turn["response"], turn["output_ids"], turn["content"]) == (text, ids, ANSWER)
    kept = _record(family, text, ids, skip=True)["turns"][0]  # SGLang deleted special tokens: text, not a token
    assert kept["content"] == text.strip()


def test_an_export_row_is_exact_only_where_the_ids_after_the_answer_are_the_templates_end(
        tokenizers: dict[str, Any], tmp_path: Path) -> None:
    """Stripped fields render the template's own end of turn after the answer: exact where the model's ids end
    the same way (the answer, then the stop token the server trimmed from the text); an end token written inside
    the answer is gone from ``content``, so the row renders otherwise than ``output_ids``: counted inexact."""
    tok = tokenizers["qwen3"]
    prompt = Renderer(tok).render(PROMPT).input_ids
    end = tok.convert_tokens_to_ids("<|im_end|>")
    turn = {"role": "assistant", "content": ANSWER, "reasoning_content": "Easy."}
    whole = Renderer(tok).render([*PROMPT, turn], generation_prompt=False).input_ids
    assert whole[:len(prompt)] == prompt
    body = whole[len(prompt):whole.index(end, len(prompt))]  # what the template renders the model wrote
    more = tok(" More.", add_special_tokens=False).input_ids
    recs = []
    for sid, ids in (("end", [*body, end]), ("inside", [*body, end, *more, end])):
        rec = _record("qwen3", tok.decode(ids[:-1], skip_special_tokens=False), ids, False, sid=sid, prompt=prompt)
        assert "<|im_end|>" not in rec["turns"][0]["content"]
        recs.append({**rec, "messages": PROMPT})
    ds = write_dataset(tmp_path, tok, recs)
    dest = tmp_path / "rows.jsonl"
    report = export_dataset(ds, dest, ExportOptions("openai-messages", reasoning="field", trainer="speculators"), tokenizer=tok)
    assert (report.written, report.inexact, report.inexact_ids) == (1, 1, ["inside"])
    row = json.loads(dest.read_text())
    assert row["id"] == "end" and row["conversations"][-1]["content"] == ANSWER


def test_kimi_k2_sends_special_tokens_so_its_end_is_stripped(tokenizers: dict[str, Any]) -> None:
    """The family the issue is about: its call markers are special, so its runs keep special tokens in the text."""
    assert special_markers("kimi_k2", tokenizers["kimi_k2"])
