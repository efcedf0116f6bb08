"""Export of multi-turn records (issue 14): whole conversations, ``--per-turn`` rows and one tokens row per turn,
on synthetic version 2 records whose every turn's prompt digest is computed here by rendering the regenerated
history as a worker does (so the export's id-by-id check is real), for a Qwen3-style family (earlier turns'
reasoning dropped by the template) and one whose template keeps every turn's reasoning; tool-call turns with the
dataset's tool results spliced; incomplete conversations in every format; one-turn records exactly as before."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from budget.record import make_record, make_turn, prompt_digest
from producer.export.writer import ExportError, ExportOptions, export_dataset
from render.chat import Renderer, load_tokenizer
from tests.exports import write_dataset
from tests.families import build_family_tokenizer

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
U1 = {"role": "user", "content": "Write a function that returns the sum of a list."}
U2 = {"role": "user", "content": "Make sure it handles an empty list."}
U3 = {"role": "user", "content": "Now add type hints."}
UW = {"role": "user", "content": "What is the weather like in Paris today?"}
TOOL = {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "{\"temp\": 21}"}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
#: A dataset assistant turn: never sent, never exported (the record's messages do not hold it).
DATASET_ANSWER = "THE DATASET'S OWN ANSWER"


def _keep_reasoning_template(template: str) -> str:
    """The Qwen3 test template with every assistant turn's reasoning kept (a "preserved thinking" template)."""
    old = "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}"
    assert old in template
    return template.replace(old, "{%- if reasoning_content %}")


@pytest.fixture(scope="module", params=["qwen3", "keep"])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    directory = build_family_tokenizer(tmp_path_factory.mktemp(request.param), "qwen3")
    if request.param == "keep":
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8"))
        config["chat_template"] = _keep_reasoning_template(config["chat_template"])
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return request.param, load_tokenizer(directory)


def response_text(reasoning: str, content: str, calls: list[dict[str, Any]]) -> str:
    """What a Qwen3 model writes (the prompt does not open the think block), tool calls as the template
    renders them back."""
    text = f"<think>\n{reasoning}\n</think>\n\n{content}"
    for i, call in enumerate(calls):
        if i or content:
            text += "\n"
        fn = call["function"]
        text += f'<tool_call>\n{{"name": "{fn["name"]}", "arguments": {fn["arguments"]}}}\n</tool_call>'
    return text


def conversation_record(tok: Any, sid: str, steps: list[Any], *, incomplete: bool = False,
                        stopped_by: str | None = None,
                        tools: list[dict[str, Any]] | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A record as the worker and collector would write it. ``steps`` are messages sent (system, user, tool)
    and turns to generate (``("turn", reasoning, content, calls, finish)``) in conversation order. Each turn's
    prompt is rendered here from the history built step by step (the earlier turns as assistant messages with
    ``reasoning_content`` and ``tool_calls``), its digest taken of those ids. Returns the record and, per turn,
    the prompt messages and response (for the assertions). ``tools``: the record's, every prompt rendered with
    them."""
    renderer = Renderer(tok)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    sent: list[dict[str, Any]] = []
    history: list[dict[str, Any]] = []
    turns, seen = [], []
    for step in steps:
        if isinstance(step, dict):
            sent.append(step)
            history.append(step)
            continue
        _kind, reasoning, content, calls, finish = step
        prompt_ids = renderer.render(history, tools).input_ids
        response = response_text(reasoning, content, calls)
        output_ids = tok.encode(response, add_special_tokens=False) + ([eos] if finish == "stop" else [])
        turns.append(make_turn(response=response, reasoning=reasoning, content=content, reasoning_truncated=False,
                               reasoning_unclosed=False, tool_calls=calls, prompt_tokens=len(prompt_ids),
                               cached_tokens=0, completion_tokens=len(output_ids), finish_reason=finish,
                               prompt_ids=prompt_ids, output_ids=output_ids))
        seen.append({"prompt": list(history), "response": response, "prompt_ids": prompt_ids,
                     "output_ids": output_ids})
        message: dict[str, Any] = {"role": "assistant", "content": content, "reasoning_content": reasoning}
        if calls:
            message["tool_calls"] = calls
        history.append(message)
    rec = make_record(sample_id=sid, dataset="ds", turns=turns, reasoning_parser="qwen3",
                      sampling_params={"max_new_tokens": 64}, messages=sent, tools=tools)
    if len(turns) > 1 or incomplete:
        rec["incomplete"], rec["stopped_by"] = incomplete, stopped_by
    return rec, seen


def T(reasoning: str, content: str, calls: list[dict[str, Any]] | None = None, finish: str = "stop") -> tuple:
    return ("turn", reasoning, content, calls or [], finish)


def records(tok: Any) -> dict[str, tuple[dict[str, Any], list[dict[str, Any]]]]:
    return {
        "chat": conversation_record(tok, "chat", [SYSTEM, U1, T("Sum it.", "def total(xs):\n    return sum(xs)"),
                                                  U2, T("Empty is fine.", "sum([]) is 0 already."),
                                                  U3, T("Hints.", "def total(xs: list[int]) -> int: ...")]),
        "tools": conversation_record(tok, "tools", [SYSTEM, UW, T("Call the tool.", "", [CALL]), TOOL,
                                                    T("It says 21.", "It is 21 degrees."),
                                                    U2, T("Still fine.", "Yes.")]),
        # ended by the budget after two of three user turns: incomplete, every turn finished
        "budget": conversation_record(tok, "budget", [U1, T("Sum.", "sum(xs)"), U2, T("Ok.", "Done.")],
                                      incomplete=True, stopped_by="budget"),
        # a turn cut by max_new_tokens ends the conversation there
        "length": conversation_record(tok, "length", [U1, T("Sum.", "sum(xs)"), U2,
                                                      T("I keep going", "and go", finish="length")],
                                      incomplete=True, stopped_by="length"),
        # the last user turn's answer cut by max_new_tokens: not incomplete, still truncated
        "cut-last": conversation_record(tok, "cut-last", [U1, T("Sum.", "sum(xs)"), U2,
                                                          T("Hmm", "Sure, here", finish="length")]),
    }


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def export(ds: Path, tmp_path: Path, tok: Any, **kwargs: Any) -> tuple[list[dict[str, Any]], Any]:
    dest = tmp_path / f"x{len(list(tmp_path.iterdir()))}.jsonl"
    if "trainer" not in kwargs:
        kwargs.setdefault("per_turn", False)
    options = ExportOptions(**kwargs)
    report = export_dataset(ds, dest, options, tokenizer=tok if options.needs_tokenizer else None)
    return read_jsonl(dest), report


def assistant(reasoning: str, content: str, calls: list[dict[str, Any]] | None = None,
              mode: str = "inline") -> dict[str, Any]:
    msg: dict[str, Any] = ({"role": "assistant", "content": f"<think>\n{reasoning}\n</think>\n\n{content}"}
                           if mode == "inline" else
                           {"role": "assistant", "content": content, "reasoning_content": reasoning})
    if calls:
        msg["tool_calls"] = calls
    return msg


# -- whole conversations -----------------------------------------------------------------------------------------


def test_openai_messages_is_the_regenerated_conversation(tmp_path: Path, family: tuple[str, Any]) -> None:
    """system, u1, a1', [tool results], u2, a2', ...: the model's turns in place, the dataset's never."""
    _name, tok = family
    recs = records(tok)
    ds = write_dataset(tmp_path, tok, [recs["chat"][0], recs["tools"][0]])
    rows, report = export(ds, tmp_path, tok, format="openai-messages")
    assert report.written == 2 and report.conversations == 2
    chat, tools = rows
    assert chat == {"id": "chat", "conversations": [
        SYSTEM, U1, assistant("Sum it.", "def total(xs):\n    return sum(xs)"),
        U2, assistant("Empty is fine.", "sum([]) is 0 already."),
        U3, assistant("Hints.", "def total(xs: list[int]) -> int: ...")]}
    assert tools["conversations"] == [SYSTEM, UW, assistant("Call the tool.", "", [CALL]), TOOL,
                                 assistant("It says 21.", "It is 21 degrees."), U2, assistant("Still fine.", "Yes.")]
    assert DATASET_ANSWER not in json.dumps(rows)


def test_sharegpt_is_the_same_conversation(tmp_path: Path, family: tuple[str, Any]) -> None:
    _name, tok = family
    recs = records(tok)
    ds = write_dataset(tmp_path, tok, [recs["tools"][0]])
    (row,), _report = export(ds, tmp_path, tok, format="sharegpt", reasoning="field")
    froms = [t["from"] for t in row["conversations"]]
    assert froms == ["system", "human", "gpt", "tool", "gpt", "human", "gpt"]
    call_turn = row["conversations"][2]
    assert call_turn["value"] == "" and call_turn["tool_calls"] == [CALL]
    assert call_turn["reasoning_content"] == "Call the tool."
    assert row["conversations"][3]["tool_call_id"] == "call_1"
    assert [t.get("reasoning_content") for t in row["conversations"] if t["from"] == "gpt"] == [
        "Call the tool.", "It says 21.", "Still fine."]


def test_whole_conversation_is_exact_only_where_the_template_keeps_earlier_turns(
        tmp_path: Path, family: tuple[str, Any]) -> None:
    """Rendering the whole exported conversation gives the last turn's prompt + its response in both families;
    every earlier turn's prompt + response is a prefix of it only with the template that keeps reasoning. The
    Qwen3-style template drops the earlier reasoning: lossy for every turn but the last (docs/export.md)."""
    name, tok = family
    rec, seen = records(tok)["chat"]
    ds = write_dataset(tmp_path, tok, [rec])
    (row,), _report = export(ds, tmp_path, tok, format="openai-messages", reasoning="field")
    whole = tok.apply_chat_template(row["conversations"], tokenize=False)
    last = seen[-1]
    assert whole == tok.apply_chat_template(last["prompt"], tokenize=False, add_generation_prompt=True) \
        + last["response"] + "<|im_end|>\n"
    first = seen[0]
    turn_one = tok.apply_chat_template(first["prompt"], tokenize=False, add_generation_prompt=True) \
        + first["response"]
    assert whole.startswith(turn_one) is (name == "keep")
    assert ("Sum it." in whole) is (name == "keep")


# -- per turn ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reasoning", ["inline", "field"])
def test_per_turn_rows_render_as_each_turn_was_generated(tmp_path: Path, family: tuple[str, Any],
                                                         reasoning: str) -> None:
    """--per-turn: row i is the history turn i's prompt was rendered from, then turn i; through the template it
    is exactly that prompt + the turn's response + end of turn, in both families, tool turns included."""
    _name, tok = family
    recs = records(tok)
    ds = write_dataset(tmp_path, tok, [recs["chat"][0], recs["tools"][0]])
    rows, report = export(ds, tmp_path, tok, format="openai-messages", per_turn=True, reasoning=reasoning)
    assert [(r["id"], r["turn"]) for r in rows] == [("chat", 0), ("chat", 1), ("chat", 2),
                                                   ("tools", 0), ("tools", 1), ("tools", 2)]
    assert report.written == 6 and report.conversations == 2
    seen = recs["chat"][1] + recs["tools"][1]
    for row, turn in zip(rows, seen, strict=True):
        assert row["conversations"][:-1] == turn["prompt"]
        rendered = tok.apply_chat_template(row["conversations"], tokenize=False)
        prompt = tok.apply_chat_template(turn["prompt"], tokenize=False, add_generation_prompt=True)
        assert rendered == prompt + turn["response"] + "<|im_end|>\n", (row["id"], row["turn"])


def test_per_turn_sharegpt_and_token_ids(tmp_path: Path, family: tuple[str, Any]) -> None:
    _name, tok = family
    rec, seen = records(tok)["tools"]
    ds = write_dataset(tmp_path, tok, [rec])
    rows, report = export(ds, tmp_path, tok, format="sharegpt", per_turn=True, token_ids=True)
    assert [len(r["conversations"]) for r in rows] == [3, 5, 7]
    for row, turn in zip(rows, seen, strict=True):
        assert row["input_ids"] == turn["prompt_ids"] and row["output_ids"] == turn["output_ids"]
    assert report.prompt_mismatch == 0


def test_token_ids_on_a_whole_multi_turn_conversation_is_refused(tmp_path: Path, family: tuple[str, Any]) -> None:
    _name, tok = family
    ds = write_dataset(tmp_path, tok, [records(tok)["chat"][0]])
    dest = tmp_path / "x.jsonl"
    with pytest.raises(ExportError, match=r"raw_responses.jsonl:1: 3 turns: --token-ids .* --per-turn"):
        export_dataset(ds, dest, ExportOptions("openai-messages", token_ids=True, per_turn=False), tokenizer=tok)
    assert not dest.exists()


# -- tokens ------------------------------------------------------------------------------------------------------


def test_tokens_is_one_checked_row_per_turn(tmp_path: Path, family: tuple[str, Any]) -> None:
    """Each turn: its prompt rendered again from the record (messages + earlier regenerated turns) must match
    the digest taken of what was sent; input_ids = those ids + the turn's output_ids, loss on the output only."""
    _name, tok = family
    recs = records(tok)
    ds = write_dataset(tmp_path, tok, [recs["chat"][0], recs["tools"][0]])
    rows, report = export(ds, tmp_path, tok, format="tokens")
    assert report.prompt_mismatch == 0 and report.written == 6
    for row, turn in zip(rows, recs["chat"][1] + recs["tools"][1], strict=True):
        assert row["input_ids"] == turn["prompt_ids"] + turn["output_ids"]
        assert row["loss_mask"] == [0] * len(turn["prompt_ids"]) + [1] * len(turn["output_ids"])
        assert "truncated" not in row


def test_a_turn_whose_prompt_does_not_re_render_is_left_out_and_counted(tmp_path: Path,
                                                                         family: tuple[str, Any]) -> None:
    _name, tok = family
    rec, seen = records(tok)["chat"]
    rec["turns"][1]["prompt_ids_sha256"] = prompt_digest(seen[1]["prompt_ids"] + [0])
    ds = write_dataset(tmp_path, tok, [rec])
    rows, report = export(ds, tmp_path, tok, format="tokens")
    assert [r["turn"] for r in rows] == [0, 2]
    assert report.prompt_mismatch == 1 and report.mismatched_ids == ["chat"]


def test_the_dataset_answers_would_not_match(tmp_path: Path, family: tuple[str, Any]) -> None:
    """The check is real: a turn generated on the dataset's answer instead of the model's has another prompt."""
    _name, tok = family
    rec, _seen = records(tok)["chat"]
    wrong = Renderer(tok).render([SYSTEM, U1, {"role": "assistant", "content": DATASET_ANSWER}, U2]).input_ids
    rec["turns"][1]["prompt_ids_sha256"] = prompt_digest(wrong)
    ds = write_dataset(tmp_path, tok, [rec])
    _rows, report = export(ds, tmp_path, tok, format="tokens")
    assert report.prompt_mismatch == 1


# -- incomplete conversations -------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,per_turn", [("openai-messages", False), ("sharegpt", False),
                                          ("openai-messages", True), ("tokens", False)])
def test_one_option_for_truncated_and_incomplete_in_every_format(tmp_path: Path, family: tuple[str, Any],
                                                                 fmt: str, per_turn: bool) -> None:
    """--truncated drop (default) leaves out incomplete conversations (budget, length) and one whose last turn
    was cut, whole; keep writes all their rows marked truncated, so keep minus the marked rows is drop."""
    _name, tok = family
    recs = records(tok)
    ds = write_dataset(tmp_path, tok, [r for r, _s in recs.values()])
    dropped, report = export(ds, tmp_path, tok, format=fmt, per_turn=per_turn)
    assert {r["id"] for r in dropped} == {"chat", "tools"}
    assert report.dropped_truncated == 3 and report.conversations == 2
    kept, report = export(ds, tmp_path, tok, format=fmt, per_turn=per_turn, truncated="keep")
    assert report.dropped_truncated == 0 and report.conversations == 5
    marked = {r["id"] for r in kept if r.get("truncated")}
    assert marked == {"budget", "length", "cut-last"}
    assert all(r.get("truncated") for r in kept if r["id"] in marked)
    assert [r for r in kept if not r.get("truncated")] == dropped
    if fmt == "tokens" or per_turn:
        assert sum(r["id"] == "budget" for r in kept) == 2  # every turn of it, not only the last


# -- one-turn records and malformed ones ------------------------------------------------------------------------


def test_a_one_turn_record_answers_all_its_messages_as_before(tmp_path: Path, family: tuple[str, Any]) -> None:
    """A --turns last record keeps the dataset's earlier turns as context: the one turn follows them all;
    --per-turn writes the same messages with turn 0."""
    _name, tok = family
    context = [SYSTEM, UW, {"role": "assistant", "content": DATASET_ANSWER}, U2]
    rec, seen = conversation_record(tok, "last", [*context, T("Fine.", "Yes.")])
    ds = write_dataset(tmp_path, tok, [rec])
    rows, _report = export(ds, tmp_path, tok, format="openai-messages")
    expected = [*context, assistant("Fine.", "Yes.")]
    assert rows == [{"id": "last", "conversations": expected}]
    rows, _report = export(ds, tmp_path, tok, format="openai-messages", per_turn=True)
    assert rows == [{"id": "last", "turn": 0, "conversations": expected}]
    rows, report = export(ds, tmp_path, tok, format="tokens")
    assert [r["id"] for r in rows] == ["last"] and report.no_output_ids == 0
    assert rows[0]["input_ids"] == seen[0]["prompt_ids"] + seen[0]["output_ids"]


@pytest.mark.parametrize("messages,match", [
    ([U1, {"role": "assistant", "content": DATASET_ANSWER}, U2], r"messages\[1\] is an assistant message"),
    ([U1, U2, U3], r"2 turns, but messages has 3 answer points"),
    ([U1, U2, SYSTEM], r"ending before its end"),
])
def test_messages_that_do_not_interleave_with_the_turns_are_refused(tmp_path: Path, family: tuple[str, Any],
                                                                    messages: list[dict[str, Any]],
                                                                    match: str) -> None:
    _name, tok = family
    rec, _seen = records(tok)["budget"]
    rec["messages"] = messages
    ds = write_dataset(tmp_path, tok, [rec])
    for truncated in ("keep", "drop"):  # an error whether the (incomplete) record would be written or not
        with pytest.raises(ExportError, match=r"raw_responses.jsonl:1: .*" + match):
            export_dataset(ds, tmp_path / "x.jsonl", ExportOptions("openai-messages", truncated=truncated))


def test_cli_per_turn_and_truncated_keep(tmp_path: Path, family: tuple[str, Any]) -> None:
    """``produce export --per-turn --truncated keep``: the options reach the library; the line counts turn rows."""
    from click.testing import CliRunner

    from producer.cli import main
    _name, tok = family
    recs = records(tok)
    ds = write_dataset(tmp_path, tok, [recs["chat"][0], recs["budget"][0]])
    dest = tmp_path / "rows.jsonl"
    result = CliRunner().invoke(main, ["export", "ds", "--out", str(ds.parent), "--format", "openai-messages",
                                       "--per-turn", "--truncated", "keep", "--dest", str(dest)])
    assert result.exit_code == 0, result.output
    assert "ds: 5 turn rows" in result.output
    assert [(r["id"], r["turn"], r.get("truncated", False)) for r in read_jsonl(dest)] == [
        ("chat", 0, False), ("chat", 1, False), ("chat", 2, False), ("budget", 0, True), ("budget", 1, True)]


def test_the_manifest_counts_turns_and_why_conversations_stopped(tmp_path: Path, family: tuple[str, Any]) -> None:
    _name, tok = family
    ds = write_dataset(tmp_path, tok, [r for r, _s in records(tok).values()])
    export(ds, tmp_path, tok, format="openai-messages")
    manifest = json.loads((ds / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["counts"]["samples"] == 5 and manifest["counts"]["truncated"] == 3
    assert manifest["conversations"] == {"turns": 12, "multi_turn": 5, "incomplete": 2,
                                         "stopped_by": {"budget": 1, "context": 0, "failed": 0, "length": 1,
                                                        "reasoning_unclosed": 0, "tool_mismatch": 0}}


def test_a_rerun_record_supersedes_the_failed_conversation_of_the_same_id(tmp_path: Path,
                                                                          family: tuple[str, Any]) -> None:
    """A conversation whose turn 1 failed, then the rerun's record of it (reopened, carried on to its end): the
    export holds the id once, the last record, and the manifest counts it once."""
    _name, tok = family
    failed, _ = conversation_record(tok, "c", [U1, T("Sum.", "sum(xs)"), U2], incomplete=True, stopped_by="failed")
    failed["messages"] = [U1]  # it ended at turn 0's prompt
    done, _ = conversation_record(tok, "c", [U1, T("Sum.", "sum(xs)"), U2, T("Ok.", "Done.")])
    other, _ = conversation_record(tok, "d", [U1, T("A.", "b")], incomplete=True, stopped_by="failed")
    ds = write_dataset(tmp_path, tok, [failed, done, other])
    rows, report = export(ds, tmp_path, tok, format="openai-messages", truncated="keep")
    assert [r["id"] for r in rows].count("c") == 1 and report.superseded == 1
    (row,) = [r for r in rows if r["id"] == "c"]
    assert not row.get("truncated") and row["conversations"][-1]["content"].endswith("Done.")
    assert {r["id"] for r in rows} == {"c", "d"}  # a failed conversation nothing replaced is kept as it is
    manifest = json.loads((ds / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["counts"]["samples"] == 2


def test_multi_turn_rows_follow_the_trainer(tmp_path: Path, family: tuple[str, Any]) -> None:
    """--for decides the rows a conversation gives: SpecForge one per turn (it supervises every assistant span of
    a row, so the row ends at the turn it trains: train_only_last_turn), speculators one per conversation (it
    fans out per turn itself). Without --for or --per-turn/--whole, multi-turn data is refused, naming both."""
    _name, tok = family
    rec, _seen = records(tok)["chat"]
    ds = write_dataset(tmp_path, tok, [rec])
    specforge, _report = export(ds, tmp_path, tok, format="openai-messages", trainer="specforge")
    assert [r["turn"] for r in specforge] == [0, 1, 2]
    speculators, _report = export(ds, tmp_path, tok, format="sharegpt", trainer="speculators")
    assert len(speculators) == 1 and "turn" not in speculators[0]
    with pytest.raises(ExportError, match=r"raw_responses.jsonl:1: a conversation of 3 turns: .*--for specforge"):
        export(ds, tmp_path, tok, format="openai-messages", per_turn=None)


def test_rows_are_checked_as_their_trainer_renders_them(tmp_path: Path, family: tuple[str, Any]) -> None:
    """With the run's tokenizer every row is rendered as its trainer renders it and compared with each trained
    turn's prompt ids + output ids (producer/export/writer.py). SpecForge's per-turn rows and speculators' whole
    rows are exact with both templates; a whole row read by SpecForge trains the earlier turns on the whole
    conversation's rendering, which the Qwen3-style template renders without their reasoning: counted and left
    out, or kept marked. speculators with per-turn rows would train each turn's history again: refused."""
    name, tok = family
    rec, _seen = records(tok)["chat"]
    ds = write_dataset(tmp_path, tok, [rec])
    dest = tmp_path / "x.jsonl"
    for trainer, per_turn, written, inexact in (("specforge", None, 3, 0), ("speculators", None, 1, 0),
                                                ("specforge", False, 0 if name == "qwen3" else 1,
                                                 1 if name == "qwen3" else 0)):
        options = ExportOptions("openai-messages", reasoning="field", trainer=trainer, per_turn=per_turn)
        report = export_dataset(ds, dest, options, tokenizer=tok)
        assert (report.written, report.inexact, report.unchecked) == (written, inexact, 0), (trainer, per_turn)
    kept = export_dataset(ds, dest, ExportOptions("sharegpt", trainer="specforge", per_turn=False, inexact="keep"),
                          tokenizer=tok)
    assert kept.written == 1 and read_jsonl(dest)[0].get("inexact", False) is (name == "qwen3")
    unchecked = export_dataset(ds, dest, ExportOptions("sharegpt", trainer="speculators"))
    assert (unchecked.written, unchecked.unchecked) == (1, 1)  # no tokenizer: written, counted as unchecked
    with pytest.raises(ExportError, match="--for speculators reads whole conversations"):
        ExportOptions("sharegpt", trainer="speculators", per_turn=True)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.parametrize(("trainer", "rows"), [("specforge", 3), ("speculators", 1)])
def test_rows_of_a_record_with_tools_are_checked_rendered_with_them(tmp_path: Path, family: tuple[str, Any],
                                                                   trainer: str, rows: int) -> None:
    """A record's ``tools`` (its prompts were rendered with them) go on its rows, and both trainers pass a row's
    ``tools`` to the chat template (SpecForge: ``apply_chat_template(..., tools=tools or None)``; speculators: the
    render request's ``tools``): the check renders with them too, so the rows are exact, not left out."""
    _name, tok = family
    rec, seen = conversation_record(tok, "tools", [SYSTEM, UW, T("Call the tool.", "", [CALL]), TOOL,
                                                   T("It says 21.", "It is 21 degrees."), U2, T("Still fine.", "Yes.")],
                                    tools=[WEATHER_TOOL])
    assert "The weather in a city" in tok.decode(seen[0]["prompt_ids"])  # the template renders them
    ds = write_dataset(tmp_path, tok, [rec])
    for fmt in ("openai-messages", "sharegpt"):
        dest = tmp_path / f"{fmt}.jsonl"
        report = export_dataset(ds, dest, ExportOptions(fmt, reasoning="field", trainer=trainer), tokenizer=tok)
        got = read_jsonl(dest)
        assert (report.written, report.inexact, report.unchecked, report.prompt_mismatch) == (rows, 0, 0, 0), fmt
        assert all(row["tools"] == [WEATHER_TOOL] for row in got)
