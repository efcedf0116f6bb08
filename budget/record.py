"""The two formats a sample crosses the processes in: the chunk job payload a worker reads, and the output
record it writes, one line of ``raw_responses.jsonl`` (record version 2, ``RECORD_VERSION``).

The chunk job payload (below the record and its conversation) is the one contract between the producer and the
workers. A chunk is one RQ job (JSON-serialized, never pickle). It carries everything a worker needs so the worker
never imports transformers or reads the dataset files: the rendered ``input_ids`` of each sample, the sampling
parameters and the thinking markers of the chat template. A payload of another ``VERSION`` is refused
(``OTHER_VERSION`` says what to do).

The output record:

A record is a conversation with a list of regenerated turns (one per assistant answer the model made):

- record: ``record_version`` (2), ``id``, ``dataset``, ``messages`` (what was sent, the dataset's own assistant
  answer removed), ``tools`` (only on a record whose dataset record had tool definitions: every turn's prompt was
  rendered with them), ``turns``, ``completion_tokens`` (the sum over turns: what the budget counted), ``incomplete``,
  ``stopped_by``, ``reasoning_parser``, ``sampling_params``;
- turn: what SGLang answered (``response``, ``output_ids``, the counts, ``finish_reason``), the worker's parse of it
  (``reasoning``, ``content``, ``reasoning_truncated``, ``reasoning_unclosed``, ``tool_calls``, and
  ``tool_call_errors``: calls that did not parse and stayed text), and
  ``prompt_ids_sha256``: a digest of the prompt ids the turn was generated from, so an export that renders the
  prompt again can prove id by id that it has the ids the model saw, without storing them (docs/export.md has
  the measured sizes: the prompt ids would roughly double a record, the digest costs 86 bytes).

A record of another version is refused where the file is read (producer/results.py ``iter_results``).

Lives in budget/ because both sides build it: the worker the turn and the record without ``messages``
(`worker.sglang.result_record`), the producer adds ``messages`` and writes the line (`producer.results`).
The conversation a record makes (below the record): how a record's ``messages`` and ``turns`` make one conversation: which messages each regenerated turn answers,
the message a regenerated turn becomes in the prompts after it, and what follows a regenerated turn.

One definition for every side that needs it (the worker rendering turn i+1, the export rendering turn i again to
check its digest, the export writing the conversation), because one message of difference between them is a
prompt whose digest no longer matches, or a training row that is not what the model saw. docs/export.md
("Multi-turn records") states the rule; in short:

- A one-turn record answers all of its ``messages`` (what ``--turns last`` and every record before multi-turn
  wrote: they may hold the dataset's own earlier assistant turns, kept as context).
- A record of k > 1 turns holds in ``messages`` only what was sent besides the model's own turns: system, user
  turns and the dataset's tool results spliced after a turn that called tools (never an assistant message). An
  *answer point* is the end of a user message and the end of a run of consecutive tool messages; turn i answers
  the i-th answer point, and the last turn answers the end of ``messages``, so there are exactly k points and
  the last is the end. Turn i's prompt is the messages up to its point with turns 0..i-1 inserted at theirs.
- In a prompt, a regenerated turn is `history_message`: its ``content``, its ``reasoning`` as
  ``reasoning_content`` (when the parser split one) and its parsed ``tool_calls``. The chat template decides what
  of it to render (Qwen3 drops the reasoning of turns before the last user message; a template that keeps
  reasoning renders it).

What comes after a regenerated turn (`walk`): the next turn's prompt messages, or why the conversation ends
there. Pure functions over the dataset's `plan` and the turns regenerated so far, so a worker that resumes a
conversation another worker started (its chunk's lease lapsed) walks the same path from the committed turns alone:
the decisions of turns 0..i depend on nothing but those turns and the dataset. Both sides walk it: the worker
between turns (worker/turns.py), the producer when it ends a started conversation that can no longer go on (its
dataset closed after the worker carrying it died: `end_as_is`). The rules (docs/multiturn.md, "Stopping rules"):

- turn i answers step ``at[i]`` of the plan; the next turn answers the next step;
- a turn that calls tools continues with the dataset's tool results only when it calls the same functions, in the
  same order, as the dataset's answer at that step and the dataset's next step is those results; otherwise the
  conversation stops with ``tool_mismatch``. The results' ``tool_call_id`` become the regenerated calls' ids
  (the dataset's ids name calls the model never made);
- a turn without tool calls where the dataset called tools skips the dataset's tool exchange, to the next step
  that is not a run of tool results (those answer calls the model did not make);
- a turn cut by ``max_new_tokens`` (``finish_reason: length``) before the last step stops with ``length``.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Final, Mapping, NotRequired, Sequence, TypedDict

import orjson

from budget import keys

RECORD_VERSION: Final = 2
RECORD_FIELDS: Final = ("record_version", "id", "dataset", "messages", "turns", "completion_tokens", "incomplete",
                        "stopped_by", "reasoning_parser", "sampling_params")
TURN_FIELDS: Final = ("response", "reasoning", "content", "reasoning_truncated", "reasoning_unclosed",
                      "tool_calls", "tool_call_errors", "prompt_tokens", "cached_tokens", "completion_tokens", "finish_reason",
                      "prompt_ids_sha256", "output_ids")
#: The one vocabulary of ``stopped_by``: why a record's conversation ended before its planned end (null: it did
#: not), whether it has one turn or many (docs/multiturn.md "Stopping rules").
LENGTH: Final = "length"  # a turn was cut by max_new_tokens (SGLang's finish_reason "length")
REASONING_UNCLOSED: Final = "reasoning_unclosed"  # the model stopped (EOS) inside an unclosed thinking block
BUDGET: Final = "budget"  # the dataset closed before the conversation's next turn
FAILED: Final = "failed"  # a turn's every attempt failed; the record keeps the turns before it
CONTEXT: Final = "context"  # the next turn's prompt leaves no room for a completion
TOOL_MISMATCH: Final = "tool_mismatch"  # the model's tool calls do not match the dataset's tool results
STOPPED_BY: Final = (LENGTH, REASONING_UNCLOSED, BUDGET, FAILED, CONTEXT, TOOL_MISMATCH)


def prompt_digest(ids: Sequence[int]) -> str:
    """sha256 hex of the prompt ids written as decimal numbers joined by commas (``"1,2,3"``): easy to recompute
    in any language, and a different id anywhere gives a different digest.

    That text is orjson's JSON array of the ids without its brackets (ints in decimal, no spaces); the worker takes
    it of every prompt it sends, and ``",".join(map(str, ids))`` cost 6-9x as much (9 µs for 30 ids, 580 µs
    for 3,000 on the bench machine)."""
    return hashlib.sha256(orjson.dumps(ids if isinstance(ids, list) else list(ids),
                                       option=orjson.OPT_SERIALIZE_NUMPY)[1:-1]).hexdigest()


def make_turn(*, response: str, reasoning: str | None, content: str, reasoning_truncated: bool,
              reasoning_unclosed: bool, tool_calls: list[dict[str, Any]], prompt_tokens: int, cached_tokens: int,
              completion_tokens: int, finish_reason: str, prompt_ids: Sequence[int] | None,
              output_ids: list[int] | None, tool_call_errors: int = 0) -> dict[str, Any]:
    """One regenerated turn, fields in TURN_FIELDS order. ``prompt_ids`` are hashed, not stored."""
    return {
        "response": response, "reasoning": reasoning, "content": content,
        "reasoning_truncated": reasoning_truncated, "reasoning_unclosed": reasoning_unclosed,
        "tool_calls": tool_calls, "tool_call_errors": tool_call_errors, "prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens,
        "completion_tokens": completion_tokens, "finish_reason": finish_reason,
        "prompt_ids_sha256": prompt_digest(prompt_ids) if prompt_ids is not None else None,
        "output_ids": output_ids,
    }


def make_record(*, sample_id: str, dataset: str, turns: list[dict[str, Any]], reasoning_parser: str | None,
                sampling_params: Mapping[str, Any], messages: Any = None,
                chat_template_kwargs: Mapping[str, Any] | None = None,
                tools: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """A version 2 record over ``turns``; ``messages`` is filled by the producer when it writes the line.
    ``tools``: the sample's tool definitions, kept after ``messages`` (left out when it has none).
    ``chat_template_kwargs``: what a sample of a ``--template-kwargs-mix`` was rendered with (the field is left
    out otherwise: the run's, in run.json)."""
    incomplete, stopped_by = _ending(turns)
    rec = {
        "record_version": RECORD_VERSION, "id": sample_id, "dataset": dataset, "messages": messages,
        **({"tools": [dict(t) for t in tools]} if tools else {}), "turns": turns, "completion_tokens": sum(int(t["completion_tokens"]) for t in turns),
        "incomplete": incomplete, "stopped_by": stopped_by, "reasoning_parser": reasoning_parser,
        "sampling_params": dict(sampling_params),
    }
    if chat_template_kwargs is not None:
        rec["chat_template_kwargs"] = dict(chat_template_kwargs)
    return rec


def _ending(turns: Sequence[Mapping[str, Any]]) -> tuple[bool, str | None]:
    """(incomplete, stopped_by) from the last turn: a turn cut by max_new_tokens, or stopped inside a thinking
    block it never closed, is not a finished turn, whatever a chat template would make of it."""
    if not turns:
        return True, None
    last = turns[-1]
    if last.get("finish_reason") == "length" or last.get("reasoning_truncated"):
        return True, LENGTH
    if last.get("reasoning_unclosed"):
        return True, REASONING_UNCLOSED
    return False, None


def ordered(rec: Mapping[str, Any]) -> dict[str, Any]:
    """``rec`` with its fields in the documented order, unknown keys after them."""
    out = {k: rec.get(k) for k in RECORD_FIELDS}
    if "generation" in rec:  # beside the id it completes (docs/generations.md)
        out = {**{k: out[k] for k in list(out)[:list(out).index("id") + 1]}, "generation": rec["generation"], **out}
    out.update((k, v) for k, v in rec.items() if k not in out)
    turns = out.get("turns")
    if isinstance(turns, list):
        out["turns"] = [_ordered_turn(t) for t in turns]
    return out


def _ordered_turn(turn: Any) -> Any:
    if not isinstance(turn, dict):
        return turn
    out = {k: turn.get(k) for k in TURN_FIELDS}
    out.update((k, v) for k, v in turn.items() if k not in out)
    return out


def is_truncated(rec: Mapping[str, Any]) -> bool:
    """A record that ``--truncated drop`` leaves out: incomplete (its conversation ended before
    its last user turn, or its last turn is unfinished), or with a turn cut by max_new_tokens or stopped inside
    an unclosed thinking block (a multi-turn record's truncated last turn is not ``incomplete``). A chat template
    would still close such a turn as a finished one."""
    return bool(rec["incomplete"]) or any(
        t.get("finish_reason") == "length" or t.get("reasoning_truncated") or t.get("reasoning_unclosed")
        for t in rec["turns"])


# -- the conversation a record makes (the module's docstring, "The conversation") ------------------------------

class HistoryError(ValueError):
    """A record whose messages and turns do not interleave (a bug in what wrote it), with a message naming the
    field."""


def history_message(turn: Mapping[str, Any]) -> dict[str, Any]:
    """The assistant message a regenerated turn is in the prompt of every later turn."""
    message: dict[str, Any] = {"role": "assistant", "content": turn.get("content") or ""}
    if turn.get("reasoning") is not None:
        message["reasoning_content"] = turn["reasoning"]
    if turn.get("tool_calls"):
        message["tool_calls"] = [dict(call) for call in turn["tool_calls"]]
    return message


def answer_points(messages: Sequence[Mapping[str, Any]], turns: int) -> list[int]:
    """Where each turn goes: the number of ``messages`` before turn i, for every turn (non-decreasing, the last
    = ``len(messages)``). Raises HistoryError when a multi-turn record's messages do not fit its turns."""
    if turns == 1:
        return [len(messages)]
    points = []
    for j, message in enumerate(messages):
        role = message.get("role")
        if role == "assistant":
            raise HistoryError(f"messages[{j}] is an assistant message: a record of {turns} turns holds only what "
                               "was sent besides the model's own turns (system, user, tool)")
        following = messages[j + 1].get("role") if j + 1 < len(messages) else None
        if role == "user" or (role == "tool" and following != "tool"):
            points.append(j + 1)
    if len(points) != turns or not points or points[-1] != len(messages):
        raise HistoryError(f"turns: {turns} turns, but messages has {len(points)} answer points (user messages and "
                           "runs of tool results) ending "
                           f"{'at its end' if points and points[-1] == len(messages) else 'before its end'}")
    return points


def conversation(messages: Sequence[Mapping[str, Any]], answers: Sequence[Mapping[str, Any]],
                 points: Sequence[int], upto: int | None = None) -> list[dict[str, Any]]:
    """``messages`` with ``answers[i]`` (assistant messages, one per turn) inserted at ``points[i]``, for the
    turns before ``upto`` (all when None): turn ``upto``'s prompt, or the whole conversation."""
    count = len(answers) if upto is None else upto
    out: list[dict[str, Any]] = []
    start = 0
    for i in range(count):
        out.extend(dict(m) for m in messages[start:points[i]])
        out.append(dict(answers[i]))
        start = points[i]
    end = len(messages) if upto is None or upto >= len(points) else points[upto]
    out.extend(dict(m) for m in messages[start:end])
    return out


def turn_prompts(messages: Sequence[Mapping[str, Any]],
                 turns: Sequence[Mapping[str, Any]]) -> list[list[dict[str, Any]]]:
    """The messages each turn was rendered from (with ``add_generation_prompt``), in turn order."""
    points = answer_points(messages, len(turns))
    history = [history_message(t) for t in turns]
    return [conversation(messages, history, points, upto=i) for i in range(len(turns))]


class Step:
    """One turn of a conversation to regenerate, as the dataset lays it out: the messages sent before it (a user
    message, or the dataset's tool results after a turn that called tools; the system message and the first user
    message for turn 0) and the names of the tools the dataset's own answer at that point called, in order (empty:
    it called none, or the dataset has no answer there)."""

    __slots__ = ("context", "calls", "after_tools")

    def __init__(self, context: list[dict[str, Any]], calls: list[str], after_tools: bool) -> None:
        self.context = context
        self.calls = calls
        self.after_tools = after_tools  # the context is a run of tool results (spliced only after matching calls)

    def __repr__(self) -> str:
        return f"Step({self.context!r}, calls={self.calls!r}, after_tools={self.after_tools})"


def tool_names(message: Mapping[str, Any]) -> list[str]:
    """The function names an assistant message calls, in order (OpenAI shape: ``function.name``, or ``name``)."""
    names = []
    for call in message.get("tool_calls") or []:
        if not isinstance(call, Mapping):
            continue
        fn = call.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else call.get("name")
        names.append(str(name))
    return names


def plan(messages: Sequence[Mapping[str, Any]]) -> list[Step]:
    """The turns a dataset conversation becomes under ``--turns all``: one Step per answer point of its
    non-assistant messages (the rule of ``answer_points``), each with the dataset's tool calls at that point.
    The dataset's assistant messages are never sent; only their tool-call names are kept, to decide whether the
    dataset's tool results may follow a regenerated turn (docs/multiturn.md)."""
    steps: list[Step] = []
    context: list[dict[str, Any]] = []
    for j, message in enumerate(messages):
        role = message.get("role")
        if role == "assistant":
            if steps:
                steps[-1].calls.extend(tool_names(message))
            continue
        context.append(dict(message))
        following = messages[j + 1].get("role") if j + 1 < len(messages) else None
        if role == "user" or (role == "tool" and following != "tool"):
            steps.append(Step(context, [], after_tools=role == "tool"))
            context = []
    if context and steps:  # messages after the last answer point (none: a record ends with a user or tool turn)
        steps[-1].context.extend(context)
    return steps


@dataclass
class Walk:
    """A conversation after its regenerated turns: what was sent besides them (``sent``, the record's
    ``messages``), the next turn's prompt messages (None: it ends), and why it ends early (``stopped_by``)."""

    sent: list[dict[str, Any]]
    prompt: list[dict[str, Any]] | None
    stopped_by: str | None = None
    steps_done: int = 0  # the plan steps answered or skipped so far
    at: list[int] = field(default_factory=list)  # the step each turn answered
    answered: list[dict[str, Any]] = field(default_factory=list)  # ``sent`` up to the last turn's prompt

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The record's ``messages`` if the conversation ends here: what its turns were sent, not the context of a
        next turn that never went out (a record's last turn answers the end of its messages)."""
        return self.sent if self.prompt is None else self.answered


def _with_call_ids(context: Sequence[Mapping[str, Any]], turn: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The dataset's tool results after ``turn``, their ``tool_call_id`` replaced by the regenerated calls' ids in
    order (a result without the key keeps none)."""
    ids = [call.get("id") for call in turn.get("tool_calls") or []]
    out = []
    k = 0
    for message in context:
        m = dict(message)
        if m.get("role") == "tool" and "tool_call_id" in m and k < len(ids) and ids[k] is not None:
            m["tool_call_id"] = ids[k]
        if m.get("role") == "tool":
            k += 1
        out.append(m)
    return out


def walk(steps: Sequence[Step], turns: Sequence[Mapping[str, Any]]) -> Walk:
    """Replay ``turns`` (the regenerated turns, in order) over the dataset's ``steps``."""
    if not steps:
        raise ValueError("a conversation has at least one step (a user message)")
    sent: list[dict[str, Any]] = [dict(m) for m in steps[0].context]
    history: list[dict[str, Any]] = [dict(m) for m in sent]
    at: list[int] = []
    answered: list[dict[str, Any]] = []
    pos = 0
    for turn in turns:
        at.append(pos)
        history.append(history_message(turn))
        if pos + 1 >= len(steps):  # the dataset's last step: the conversation is over, however this turn ended
            return Walk(sent, None, None, pos + 1, at)
        if turn.get("finish_reason") == "length":
            return Walk(sent, None, LENGTH, pos + 1, at)
        calls = tool_names(turn)
        if calls:
            nxt = steps[pos + 1]
            if calls != steps[pos].calls or not nxt.after_tools:
                return Walk(sent, None, TOOL_MISMATCH, pos + 1, at)
            pos += 1
            context = _with_call_ids(nxt.context, turn)
        else:
            pos += 1
            while pos < len(steps) and steps[pos].after_tools:
                pos += 1  # the dataset's tool results answer calls this turn did not make
            if pos >= len(steps):
                return Walk(sent, None, None, pos, at)
            context = [dict(m) for m in steps[pos].context]
        answered = list(sent)
        sent.extend(context)
        history.extend(context)
    return Walk(sent, history, None, pos, at, answered)


def header(*, sample_id: str, dataset: str, sent: list[dict[str, Any]], turns: Sequence[Mapping[str, Any]],
           stopped_by: str | None, reasoning_parser: str | None, sampling_params: Mapping[str, Any],
           failed_reason: str | None = None, chat_template_kwargs: Mapping[str, Any] | None = None,
           tools: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """The record of an ended conversation without its turns (``end_conversation`` adds the committed ones
    verbatim, in order; the collector sums ``completion_tokens``). A conversation that ran to its end is
    incomplete as a one-turn record is: when its last turn was cut or never closed its thinking block."""
    rec = make_record(sample_id=sample_id, dataset=dataset, turns=[dict(t) for t in turns],
                      reasoning_parser=reasoning_parser, sampling_params=sampling_params, messages=sent,
                      chat_template_kwargs=chat_template_kwargs, tools=tools)
    del rec["turns"]
    del rec["completion_tokens"]
    rec["record_version"] = RECORD_VERSION
    if stopped_by is not None:
        rec["incomplete"] = True
        rec["stopped_by"] = stopped_by
    if failed_reason is not None:
        rec["failed_reason"] = failed_reason
    return rec


def end_as_is(ledger: Any, name: str, sample_id: str, messages: Sequence[Mapping[str, Any]], *,
              reasoning_parser: str | None, sampling_params: Mapping[str, Any],
              stopped_by: str = BUDGET, failed_reason: str | None = None,
              chat_template_kwargs: Mapping[str, Any] | None = None,
              tools: Sequence[Mapping[str, Any]] | None = None) -> Any:
    """End a started conversation with the turns it has (``stopped_by`` budget): for one no worker carries any
    more and none may pick up, because its dataset closed after the worker carrying it died (a closed dataset
    starts nothing, and its queued chunks are discarded); or ``failed`` with ``failed_reason`` for one whose
    workers died too often (producer/session/loop.py: a rerun reopens it at the turn it had reached). Its committed turns are counted; this writes them.
    Returns the EndOutcome; MISMATCH means a worker committed a turn meanwhile (it is carried on after all)."""
    turns = ledger.committed_turns(name, sample_id)
    if not turns:
        return None
    state = walk(plan(messages), turns)
    rec = header(sample_id=sample_id, dataset=name, sent=state.messages, turns=turns,
                 stopped_by=state.stopped_by if state.prompt is None else stopped_by,
                 reasoning_parser=reasoning_parser, sampling_params=sampling_params,
                 failed_reason=failed_reason if state.prompt is not None else None,
                 chat_template_kwargs=chat_template_kwargs, tools=tools)
    return ledger.end_conversation(name, sample_id, len(turns), rec)


# -- the chunk job payload -----------------------------------------------------------------------------------

#: The run format: every chunk payload (``v``), run.json and a dataset's settings in Redis (``version``) carry it.
#: A producer or a worker refuses anything of another format (OTHER_VERSION says what to do).
VERSION: Final = 4
OTHER_VERSION: Final = "made by another budgetq version: finish it with that version, or start over with --new-run"

#: The reasoning parsers a chunk may name (worker/reasoning.py parses with them; producer/settings.py chooses one),
#: spelled as SGLang spells them: the word a user passes to ``sglang.launch_server --reasoning-parser``.
REASONING_PARSERS: Final[tuple[str, ...]] = (
    "qwen3", "qwen3-thinking", "deepseek-r1", "deepseek-v3", "glm45", "kimi", "kimi_k2", "gpt-oss", "none")

#: The job function, named by dotted string so the producer never imports worker code; the worker class
#: runs nothing else.
JOB_FUNCTION = "worker.rqworker.run_chunk"


class _SamplePayloadRequired(TypedDict):
    id: str
    input_ids: list[int]  # the prompt of the sample's first turn
    opens_think: bool  # the rendered prompt ends inside an open thinking tag


class SamplePayload(_SamplePayloadRequired, total=False):
    #: ``--turns all``, a conversation of more than one turn (``plan``): the dataset's messages
    #: (system prompt applied, trailing assistant answer dropped), from which the worker renders turn i+1 on the
    #: model's own turns 0..i. Both missing: one turn, committed with ``commit``.
    messages: list[dict[str, Any]]
    turns: int  # len(plan(messages)) > 1: the most turns the conversation makes
    #: Several generations of a prompt (docs/generations.md): what this generation sends differently from the
    #: chunk's ``sampling_params`` (a temperature of a list, a derived seed), merged over them for every turn.
    #: Missing: the chunk's.
    sampling_params: dict[str, Any]
    #: ``--template-kwargs-mix`` (docs/generations.md): the chat_template_kwargs this sample was rendered with (the
    #: run's, with its drawn values merged over them), for its record and a conversation's later turns; and, for a
    #: conversation, the fingerprint of the Renderer they make (the tokenizer files stay under the conversation
    #: block's). Missing: the run's.
    chat_template_kwargs: dict[str, Any]
    tokenizer: str
    #: The record's tool definitions (producer/inputs/records.py): ``input_ids`` were rendered with them, a
    #: conversation's later turns are (``Renderer.render(messages, tools)``), and the record carries them.
    #: Missing: the record has none.
    tools: list[dict[str, Any]]


class ConversationPayload(TypedDict):
    """What a worker needs to render later turns itself (docs/multiturn.md): the run's tokenizer files are in
    Redis under this fingerprint (budget/runstate.py), and the Renderer it builds must give that fingerprint."""

    tokenizer: str  # Renderer.fingerprint() of the producer's renderer
    chat_template_kwargs: dict[str, Any]
    max_context: int  # what produce checked turn 0 against; turn i stops with "context" past it
    open_markers: list[str] | None  # [start, end] when the parser's think markers are not the template's (Kimi)
    vocab_size: NotRequired[int]  # the model's vocabulary when known (budget/serverinfo.py): later turns are checked


class ThinkPayload(TypedDict):
    start: str
    end: str


class _ChunkPayloadRequired(TypedDict):
    v: int  # VERSION
    dataset: str
    chunk: str
    sampling_params: dict[str, Any]
    think: ThinkPayload | None
    reasoning_parser: str  # the run's (worker/reasoning.py PARSERS)
    samples: list[SamplePayload]


class ChunkPayload(_ChunkPayloadRequired, total=False):
    #: Present exactly when a sample of the chunk has ``turns`` > 1 (``--turns all``).
    conversation: ConversationPayload


def sampling_params_of(chunk: ChunkPayload, sample: SamplePayload) -> dict[str, Any]:
    """What ``sample`` sends (and its record says it was sent with): the chunk's sampling parameters, with the
    sample's own override merged over them (the chunk's object itself when there is none)."""
    override = sample.get("sampling_params")
    if not override:
        return chunk["sampling_params"]
    return {**chunk["sampling_params"], **override}


def turn_request_key(sample_id: str, turn: int) -> str:
    """What names turn ``turn`` of conversation ``sample_id`` in its rids and tool-call ids: the sample id for
    turn 0 (as a one-turn sample), ``"{turn}\x1f{sample}"`` after (ids hold no control characters: unambiguous)."""
    return sample_id if turn == 0 else f"{turn}{keys.SEP}{sample_id}"


def request_id(dataset: str, sample_id: str, attempt: int) -> str:
    """A fixed-length SGLang rid: 28 hex of hash(dataset, sample) + 4 digits of attempt.

    SGLang aborts by rid *prefix* and refuses a rid still in flight, so every rid has the same length (no rid
    is a prefix of another) and each retry of a sample gets the next attempt number.
    """
    digest = hashlib.sha256(f"{dataset}\0{sample_id}".encode()).hexdigest()[:28]
    return f"{digest}{attempt % 10000:04d}"
