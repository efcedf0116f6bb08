"""Everything ``produce`` does before it touches Redis: read, validate, render, select.

Nothing here talks to Redis, so a bad file, a template error or a prompt that does not fit the context is
found while the database is still untouched (exit 2, DBSIZE unchanged).
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Sequence

from budget.history import plan
from budget.payload import ConversationPayload
from producer.errors import UsageError
from producer.generations import SETTING as GENERATIONS, Generations, chunk_params, rounds, split_key
from render.modeldir import Context, ModelDirError, config_context
from producer.order import FILE, Order, permute
from producer.progress import progress_bar
from producer.reader import Problem, ReadResult, Sample
from producer.records import FieldMapping
from render.chat import Rendered, RenderError, Renderer
from producer.runjson import ALL, LAST, run_settings
from producer.templatemix import TemplateMix, Variants

@dataclass
class Prepared:
    """A dataset ready to enqueue: the selected samples in the order they are sent (``order``), rendered."""

    name: str
    path: Path
    samples: list[Sample]  # selected: valid, fitting the context, within --max-samples
    input_ids: dict[str, array]  # compact: 4 bytes a token instead of a Python int list's ~36
    opens_think: dict[str, bool]
    invalid: list[Problem]
    duplicates: list[Problem]
    over_context: list[Problem] = field(default_factory=list)
    beyond_max_samples: int = 0
    order: Order = Order(FILE)  # the order of ``samples``: the enqueue order, and what a budget keeps first
    #: ``--turns all``: the selected samples that are conversations of more than one turn -> their turns at most
    #: (``len(plan(messages))``); their ``input_ids`` are turn 0's prompt. Empty under ``--turns last``.
    turns: dict[str, int] = field(default_factory=dict)
    turns_mode: str = LAST
    #: ``--generations``: samples per prompt (producer/generations.py). ``samples`` are the prompts; the sample
    #: keys are ``keys()``, in rounds.
    generations: int = 1
    #: ``--template-kwargs-mix`` (producer/templatemix.py): each variant (a combination of drawn values) -> prompt id
    #: -> turn 0's prompt rendered with it, for the variants the prompt's generations drew. ``input_ids`` then holds
    #: generation 0's (the same arrays). Empty without a mix.
    variant_ids: dict[str, dict[str, array]] = field(default_factory=dict)
    variant_opens: dict[str, dict[str, bool]] = field(default_factory=dict)

    @cached_property
    def messages_by_id(self) -> dict[str, Any]:
        return {s.id: s.messages for s in self.samples}

    def keys(self, samples: Sequence[Sample] | None = None) -> list[str]:
        """The sample keys of ``samples`` (default the selected prompts), in the order they are sent: rounds,
        generation 0 of every prompt first (producer/generations.py ``rounds``)."""
        return rounds([s.id for s in (self.samples if samples is None else samples)], self.generations)

    @property
    def selected(self) -> int:
        """Samples selected: prompts x generations."""
        return len(self.samples) * self.generations

    @property
    def prompt_tokens(self) -> int:
        return sum(len(a) for a in self.input_ids.values())

    @property
    def conversations(self) -> int:
        """Selected samples that are conversations of more than one turn (``--turns all``), every generation."""
        return len(self.turns) * self.generations

    @property
    def turns_total(self) -> int:
        """The most requests the selected samples make: one each, a conversation's turns for a multi-turn one."""
        return (len(self.samples) - len(self.turns) + sum(self.turns.values())) * self.generations

    @property
    def conversation_turns(self) -> int:
        """The most turns the multi-turn conversations make, together (every generation)."""
        return sum(self.turns.values()) * self.generations

    def turns_of(self, sample_id: str) -> int:
        """The most turns of a prompt, or of a sample key (any generation of the prompt)."""
        return self.turns.get(split_key(sample_id)[0], 1)

    def prompt_length(self, prompt_id: str) -> int:
        """Turn 0's prompt length, the longest over the template variants its generations drew (a mix)."""
        lengths = [len(ids[prompt_id]) for ids in self.variant_ids.values() if prompt_id in ids]
        return max(lengths) if lengths else len(self.input_ids[prompt_id])

    def drop(self, prompt_id: str) -> None:
        """Forget a prompt's renderings (it is no longer selected)."""
        del self.input_ids[prompt_id]
        self.opens_think.pop(prompt_id, None)
        for ids in self.variant_ids.values():
            ids.pop(prompt_id, None)
        for opens in self.variant_opens.values():
            opens.pop(prompt_id, None)


def _render_part(read: ReadResult, renderer: Renderer, part: list[Sample], skip_invalid: bool,
                 invalid: list[Problem],
                 messages_of: Callable[[Sample], Sequence[Any]] = lambda s: s.messages,
                 ) -> list[tuple[Sample, Rendered]]:
    """Render a batch (``messages_of`` each sample: its whole messages, or turn 0's); a sample the template refuses
    is a bad line of the file, named by its line."""
    try:
        return list(zip(part, renderer.render_many([messages_of(s) for s in part])))
    except RenderError as exc:
        if exc.index is None:
            raise
        if not skip_invalid:
            raise RenderError(str(part[exc.index].problem(str(exc.__cause__ or exc)))) from exc
    good = []
    for sample in part:
        try:
            good.append((sample, renderer.render(messages_of(sample))))
        except RenderError as exc:
            invalid.append(sample.problem(str(exc)))
    return good


def first_turn(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Turn 0's prompt messages under ``--turns all``: the system message and the first user message (what comes
    before the first answer point: budget/history.py ``plan``)."""
    return plan(messages)[0].context


def _first_turns(read: ReadResult, renderer: Renderer, rendered: list[tuple[Sample, Rendered]], skip_invalid: bool,
                 invalid: list[Problem]) -> tuple[list[tuple[Sample, Rendered]], dict[str, int]]:
    """``--turns all``: each multi-turn sample of ``rendered`` (its whole conversation rendered, which checks the
    template on every later turn's shape before Redis is touched) with turn 0's prompt instead, and the turns of
    each. One-turn samples stay as they are: exactly what ``--turns last`` sends."""
    turns: dict[str, int] = {}
    for sample, _out in rendered:
        k = len(plan(sample.messages))
        if k > 1:
            turns[sample.id] = k
    if not turns:
        return rendered, turns
    multi = [sample for sample, _out in rendered if sample.id in turns]
    first = dict((s.id, out) for s, out in _render_part(read, renderer, multi, skip_invalid, invalid,
                                                        lambda s: first_turn(s.messages)))
    out: list[tuple[Sample, Rendered]] = []
    for sample, whole in rendered:
        if sample.id not in turns:
            out.append((sample, whole))
        elif sample.id in first:
            out.append((sample, first[sample.id]))
        else:  # turn 0 refused by the template (skip_invalid): the sample is invalid, named in ``invalid``
            del turns[sample.id]
    return out, turns


def _render_batch(read: ReadResult, renderer: Renderer, part: list[Sample], skip_invalid: bool,
                  invalid: list[Problem], turns: str) -> tuple[list[tuple[Sample, Rendered]], dict[str, int]]:
    """A batch rendered for enqueueing: each sample's prompt (turn 0's for a conversation under ``--turns all``)
    and the turns of each multi-turn conversation."""
    rendered = _render_part(read, renderer, part, skip_invalid, invalid)
    if turns == ALL:
        return _first_turns(read, renderer, rendered, skip_invalid, invalid)
    return rendered, {}


def _render_variants(read: ReadResult, variants: Variants, part: list[Sample], skip_invalid: bool,
                     invalid: list[Problem], turns: str
                     ) -> tuple[list[tuple[Sample, Rendered]], dict[str, int], dict[str, dict[str, Rendered]]]:
    """``_render_batch`` under a template kwargs mix: each sample rendered with every variant its generations
    drew. A sample one of them refuses is invalid as a whole (a prompt is selected with all its generations)."""
    needed = {s.id: variants.of(s.id) for s in part}
    got: dict[str, dict[str, Rendered]] = {s.id: {} for s in part}
    conversations: dict[str, int] = {}
    bad: set[str] = set()
    for name in dict.fromkeys(v for s in part for v in needed[s.id]):
        sub = [s for s in part if name in needed[s.id] and s.id not in bad]
        rendered, convs = _render_batch(read, variants.renderer(name), sub, skip_invalid, invalid, turns)
        ok = {s.id for s, _out in rendered}
        bad.update(s.id for s in sub if s.id not in ok)
        for s, out in rendered:
            got[s.id][name] = out
        conversations.update(convs)
    keep = [s for s in part if s.id not in bad]
    return ([(s, got[s.id][needed[s.id][0]]) for s in keep], {k: v for k, v in conversations.items() if k not in bad},
            {s.id: got[s.id] for s in keep})


def prepare(read: ReadResult, renderer: Renderer, *, max_tokens: int, max_context: int,
            max_samples: int | None, skip_invalid: bool = False,
            progress: Callable[[int], None] | None = None, context_source: str = "--max-context",
            order: Order = Order(FILE), turns: str = LAST, variants: Variants | None = None) -> Prepared:
    """Render ``read``'s samples in ``order`` and select them: valid, fitting the context, and the first
    ``max_samples`` of that order (with --order random: a seeded random subset, not the file's first lines).

    ``turns`` ``all``: a conversation of more than one turn is sent as its turn 0 (the workers render the later
    turns on the model's own answers), so its prompt and its context check are turn 0's; it is rendered whole
    as well, so a template that refuses a later turn's shape is found here (exit 2), not by a worker.

    ``variants`` (a template kwargs mix): each prompt is rendered with the variant of each of its generations,
    and checked against the context with the longest."""
    prepared = Prepared(read.name, read.path, [], {}, {}, list(read.invalid), list(read.duplicates), order=order,
                        turns_mode=turns)
    batch = 256
    samples = permute(read.samples, order)
    for start in range(0, len(samples), batch):
        if max_samples is not None and len(prepared.samples) >= max_samples:
            prepared.beyond_max_samples += len(samples) - start
            break
        part = samples[start:start + batch]
        by_variant: dict[str, dict[str, Rendered]] = {}
        if variants is None:
            rendered, conversations = _render_batch(read, renderer, part, skip_invalid, prepared.invalid, turns)
        else:
            rendered, conversations, by_variant = _render_variants(read, variants, part, skip_invalid,
                                                                   prepared.invalid, turns)
        if progress is not None:
            progress(len(part))
        for i, (sample, out) in enumerate(rendered):
            if max_samples is not None and len(prepared.samples) >= max_samples:
                prepared.beyond_max_samples += len(part) - i
                break
            outs = by_variant.get(sample.id) or {"": out}
            n = max(len(o.input_ids) for o in outs.values())
            if n + max_tokens > max_context:
                prepared.over_context.append(sample.problem(
                    f"prompt of {n} tokens + --max-tokens {max_tokens} exceeds the context of {max_context} "
                    f"({context_source})"))
                continue
            prepared.samples.append(sample)
            prepared.input_ids[sample.id] = array("i", out.input_ids)
            prepared.opens_think[sample.id] = out.opens_think
            for name, o in by_variant.get(sample.id, {}).items():
                ids = prepared.input_ids[sample.id] if o is out else array("i", o.input_ids)
                prepared.variant_ids.setdefault(name, {})[sample.id] = ids
                prepared.variant_opens.setdefault(name, {})[sample.id] = o.opens_think
            if sample.id in conversations:
                prepared.turns[sample.id] = conversations[sample.id]
    return prepared


def resolve_parser(choice: str, tokenizer: Any, renderer: Renderer) -> str:
    """``--reasoning-parser``: the name given, or for ``auto`` the one the tokenizer and template point to.
    Raises UsageError (exit 2) naming the candidates when detection is ambiguous."""
    from producer.parsers import AUTO, AmbiguousParser, detect, evidence
    if choice != AUTO:
        return choice
    try:  # does the generation prompt open <think>? (qwen3 vs qwen3-thinking)
        opens = renderer.render([{"role": "user", "content": "Hi"}]).opens_think
    except RenderError:
        opens = False
    try:
        return detect(evidence(tokenizer, opens))
    except AmbiguousParser as exc:
        raise UsageError(str(exc)) from None


@dataclass
class Inputs:
    """Everything a run (or a plan) needs from the files and the tokenizer, checked."""

    prepared: list[Prepared]
    renderer: Renderer
    sampling_params: dict[str, Any]
    settings: dict[str, Any]
    chat_template_kwargs: dict[str, Any]
    reasoning_parser: str = "none"
    context: Context = Context(0, "unknown")  # what the prompts were checked against, and where it came from
    turns: str = LAST  # --turns
    variants: Variants | None = None  # --template-kwargs-mix: the renderer of each drawn combination


    def set_generations(self, n: int) -> Generations:
        """``--generations n`` over the run's sampling parameters (``sampling_params`` and ``settings`` as they will
        be sent and stored): run.json keeps a temperature list and says ``generations`` (left out for one); the
        chunks send the list's first entry, and
        each later generation carries what it sends differently (producer/generations.py)."""
        self.settings["sampling_params"] = dict(self.sampling_params)
        self.sampling_params = chunk_params(self.sampling_params)
        if n > 1:
            self.settings[GENERATIONS] = n
        else:
            self.settings.pop(GENERATIONS, None)
        for prepared in self.prepared:
            prepared.generations = n
        return Generations.from_params(n, self.settings["sampling_params"])

    def conversation(self) -> ConversationPayload | None:
        """The chunk's ``conversation`` block (budget/payload.py) when a dataset has multi-turn conversations:
        the renderer's fingerprint (its files go to Redis under it), the template kwargs, the context turn 0 was
        checked against, and the parser's think markers when they are not the template's (Kimi)."""
        if not any(p.turns for p in self.prepared):
            return None
        from producer.parsers import PARSER_MARKERS
        markers = PARSER_MARKERS[self.reasoning_parser]
        think = self.renderer.think
        return {"tokenizer": str(self.settings["tokenizer"]), "chat_template_kwargs": dict(self.chat_template_kwargs),
                "max_context": self.context.tokens,
                "open_markers": [markers.start, markers.end] if markers is not None and markers != think else None}


def choose_context(max_context: int | None, tokenizer: Any) -> Context:
    """--max-context if given, else the tokenizer's model_max_length, else the model's config.json beside it
    (real repositories often leave model_max_length unset: transformers then says int(1e30)).
    Raises UsageError (exit 2) when none of them states one."""
    from render.chat import default_max_context
    if max_context is not None:
        return Context(max_context, "--max-context")
    from_tokenizer = default_max_context(tokenizer)
    if from_tokenizer is not None:
        return Context(from_tokenizer, "tokenizer model_max_length")
    directory = Path(str(getattr(tokenizer, "name_or_path", "") or "."))
    try:
        from_config = config_context(directory)
    except ModelDirError as exc:
        raise UsageError(f"{exc}; give --max-context") from None
    if from_config is not None:
        return from_config
    where = (f"{directory / 'config.json'} states none of max_position_embeddings, max_sequence_length, "
             "seq_length, max_seq_len, model_max_length" if (directory / "config.json").is_file() else
             f"there is no config.json in {directory}")
    raise UsageError(f"the tokenizer's model_max_length is unset and {where}: give --max-context")


def load_inputs(files: Sequence[str], *, tokenizer: str, max_tokens: int, max_context: int | None,
                max_samples: int | None, sampling_params: dict[str, Any], chat_template_kwargs: dict[str, Any],
                skip_invalid: bool, echo: Callable[[str], None], warn: Callable[[str], None],
                mapping: FieldMapping | None = None, show_progress: bool = False,
                reasoning_parser: str = "auto", order: Order = Order(FILE), turns: str = LAST,
                mix: TemplateMix | None = None, generations: int = 1) -> Inputs:
    """Read, validate and render every file. Raises UsageError (exit 2) on any input problem.

    Every dataset is prepared in ``order`` and under ``turns`` (--turns); ``mix`` (--template-kwargs-mix) renders each prompt with the values its ``generations`` drew."""
    from producer.reader import InputError, read_all
    from render.chat import load_tokenizer

    reading = progress_bar(None, "validating", show=show_progress, unit=" records")
    try:
        reads = read_all(list(files), skip_invalid, mapping=mapping or FieldMapping(), progress=reading.update)
    except InputError as exc:
        raise UsageError(str(exc)) from None
    finally:
        reading.close()
    for r in reads:
        for problem in r.invalid:
            warn(f"skipped {problem}")
        for problem in r.duplicates:
            echo(f"skipped {problem}")
    try:
        tok = load_tokenizer(tokenizer)
        renderer = Renderer(tok, chat_template_kwargs=chat_template_kwargs)
    except RenderError as exc:
        raise UsageError(str(exc)) from None
    from producer.parsers import AUTO, PARSER_MARKERS
    parser = resolve_parser(reasoning_parser, tok, renderer)
    markers = PARSER_MARKERS[parser]
    opens_markers = markers if markers is not None and markers != renderer.think else None
    if opens_markers is not None:  # Kimi's ◁think▷: opens_think must look for those
        renderer = Renderer(tok, chat_template_kwargs=chat_template_kwargs, opens_markers=opens_markers)
    echo(f"reasoning parser: {parser}" + (" (detected from the tokenizer)" if reasoning_parser == AUTO else ""))
    variants = None
    if mix is not None:
        clash = sorted(set(mix.keys) & set(chat_template_kwargs))
        if clash:
            raise UsageError(f"--template-kwargs-mix and --chat-template-kwargs both set {', '.join(clash)}: "
                              "give each key in one of them")
        variants = Variants(tok, chat_template_kwargs, mix, generations, opens_markers=opens_markers)
        echo(mix.describe())
    context = choose_context(max_context, tok)
    echo(f"context: {context.tokens:,} tokens ({context.source})")
    bar = progress_bar(sum(len(r.samples) for r in reads), "rendering", show=show_progress)
    try:
        prepared = [prepare(r, renderer, max_tokens=max_tokens, max_context=context.tokens,
                            max_samples=max_samples, skip_invalid=skip_invalid, progress=bar.update,
                            context_source=context.source, order=order, turns=turns,
                            variants=variants)
                    for r in reads]
    except RenderError as exc:
        raise UsageError(str(exc)) from None
    finally:
        bar.close()
    for p in prepared:
        for problem in p.over_context:
            echo(f"skipped {problem}")
        conversations = (f"; turns: all, {p.conversations} multi-turn conversations ({p.turns_total} requests at "
                         "most)" if p.turns_mode == ALL else "")
        echo(f"{p.name}: {len(p.samples)} samples ready ({p.prompt_tokens} prompt tokens), "
             f"{len(p.invalid)} invalid, {len(p.duplicates)} duplicate ids, {len(p.over_context)} over context; "
             f"order: {p.order.describe()}{conversations}")
    settings = run_settings(renderer, sampling_params, chat_template_kwargs,
                            mapping.system_prompt if mapping else None, parser, order, turns, mix)
    return Inputs(prepared, renderer, sampling_params, settings, chat_template_kwargs, parser, context, turns,
                  variants)
