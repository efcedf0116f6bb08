"""Everything ``produce`` does before it touches Redis: read, validate, render, select.

Nothing here talks to Redis, so a bad file, a template error or a prompt that does not fit the context is
found while the database is still untouched (exit 2, DBSIZE unchanged).
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence

from budget.record import ConversationPayload, plan
from producer.errors import UsageError
from producer.generations import Variants, rounds, split_key
from producer.inputs.reader import Problem, ReadResult, Sample
from producer.settings import ALL, DatasetSettings, RunSettings, check_max_tokens, permute, resolve
from render.chat import Rendered, Renderer, RenderError
from render.modeldir import Context, ModelDirError, config_context


class Bar(Protocol):
    def update(self, n: int) -> None: ...

    def close(self) -> None: ...


def progress_bar(total: int | None, what: str, *, show: bool, unit: str = " prompts") -> Bar:
    """A tqdm bar on stderr (``total`` None: a counter and a rate), disabled unless ``show`` (``produce`` shows
    them when stderr is a terminal and ``--quiet`` is not given; stdout carries the summary and ``--json``).
    100,000 prompts take about a minute to render: without a bar a slow run looks like a stuck one."""
    from tqdm import tqdm
    bar: Bar = tqdm(total=total, desc=what, unit=unit, leave=False, mininterval=0.5, disable=not show)
    return bar

@dataclass(frozen=True)
class Prompt:
    """A selected prompt, rendered: turn 0's prompt with each template variant its generations drew (``""``
    without a mix; generation 0's first), and the most turns it makes (1 unless a multi-turn conversation under
    ``--turns all``, whose prompt is then turn 0's)."""

    sample: Sample
    #: variant -> (input_ids, opens_think); the ids compact: 4 bytes a token instead of a Python int list's ~36
    renderings: Mapping[str, tuple[array, bool]]
    turns: int = 1

    @property
    def input_ids(self) -> array:
        """Generation 0's prompt ids."""
        return next(iter(self.renderings.values()))[0]

    @property
    def opens_think(self) -> bool:
        return next(iter(self.renderings.values()))[1]

    @property
    def length(self) -> int:
        """Turn 0's prompt length, the longest over the variants (what the context check takes)."""
        return max(len(ids) for ids, _opens in self.renderings.values())


@dataclass(frozen=True)
class Prepared:
    """A dataset ready to enqueue: its settings and the selected prompts in the order they are sent. Frozen:
    the servers' context check (producer/launch.py ``apply_server_context``) makes new ones."""

    name: str
    path: Path
    settings: DatasetSettings
    prompts: dict[str, Prompt]  # selected: valid, fitting the context, within --max-samples; by id, in send order
    invalid: list[Problem]
    duplicates: list[Problem]
    over_context: list[Problem]
    beyond_max_samples: int

    @property
    def samples(self) -> list[Sample]:
        return [prompt.sample for prompt in self.prompts.values()]

    def messages(self, prompt_id: str) -> Any:
        return self.prompts[prompt_id].sample.messages

    def tools(self, prompt_id: str) -> list[dict[str, Any]] | None:
        return self.prompts[prompt_id].sample.tools

    def keys(self) -> list[str]:
        """The sample keys of the selected prompts, in the order they are sent: rounds, generation 0 of every
        prompt first (producer/generations.py ``rounds``)."""
        return rounds(list(self.prompts), self.settings.generations.n)

    @property
    def selected(self) -> int:
        """Samples selected: prompts x generations."""
        return len(self.prompts) * self.settings.generations.n

    @property
    def prompt_tokens(self) -> int:
        return sum(len(prompt.input_ids) for prompt in self.prompts.values())

    @property
    def turns(self) -> dict[str, int]:
        """The selected conversations of more than one turn (``--turns all``) -> their turns at most."""
        return {pid: prompt.turns for pid, prompt in self.prompts.items() if prompt.turns > 1}

    @property
    def conversations(self) -> int:
        """Selected samples that are conversations of more than one turn (``--turns all``), every generation."""
        return len(self.turns) * self.settings.generations.n

    @property
    def turns_total(self) -> int:
        """The most requests the selected samples make: one each, a conversation's turns for a multi-turn one."""
        return sum(prompt.turns for prompt in self.prompts.values()) * self.settings.generations.n

    @property
    def conversation_turns(self) -> int:
        """The most turns the multi-turn conversations make, together (every generation)."""
        return sum(self.turns.values()) * self.settings.generations.n

    def turns_of(self, sample_id: str) -> int:
        """The most turns of a prompt, or of a sample key (any generation of the prompt)."""
        return self.prompts[split_key(sample_id)[0]].turns


def _render_part(read: ReadResult, renderer: Renderer, part: list[Sample], skip_invalid: bool,
                 invalid: list[Problem],
                 messages_of: Callable[[Sample], Sequence[Any]] = lambda s: s.messages,
                 check_of: Callable[[Sample], Sequence[Any] | None] = lambda s: None,
                 ) -> list[tuple[Sample, Rendered]]:
    """Render a batch (``messages_of`` each sample: its whole messages, or turn 0's), after checking the template on
    ``check_of`` each sample (None: nothing more to check) without encoding it; a sample the template refuses in
    either is a bad line of the file, named by its line (the first of the batch at fault)."""
    try:
        checked = [s for s in part if check_of(s) is not None]
        if checked:
            renderer.check_many([check_of(s) or () for s in checked], [s.tools for s in checked])
        return list(zip(part, renderer.render_many([messages_of(s) for s in part], [s.tools for s in part]),
                        strict=True))
    except RenderError as exc:
        if exc.index is None:
            raise
    good = []
    for sample in part:  # one by one, in the file's order, only after a batch found a sample at fault
        try:
            whole = check_of(sample)
            if whole is not None:
                renderer.check(whole, sample.tools)
            good.append((sample, renderer.render(messages_of(sample), sample.tools)))
        except RenderError as exc:
            if not skip_invalid:
                raise RenderError(str(sample.problem(str(exc)))) from exc
            invalid.append(sample.problem(str(exc)))
    return good


def first_turn(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Turn 0's prompt messages under ``--turns all``: the system message and the first user message (what comes
    before the first answer point: budget/record.py ``plan``)."""
    return plan(messages)[0].context


def _render_batch(read: ReadResult, renderer: Renderer, part: list[Sample], skip_invalid: bool,
                  invalid: list[Problem], turns: str) -> tuple[list[tuple[Sample, Rendered]], dict[str, int]]:
    """A batch rendered for enqueueing: each sample's prompt (turn 0's for a conversation under ``--turns all``)
    and the turns of each multi-turn conversation.

    ``--turns all``: a multi-turn conversation is also checked whole, with the dataset's answers, so that a
    template refusing a later turn's shape is found before Redis is touched. That check renders the template to
    text only (``Renderer.check_many``): its ids would never be sent, and encoding is most of a render's cost
    (docs/performance.md, figure 4). One-turn samples are rendered exactly as ``--turns last`` renders them."""
    if turns != ALL:
        return _render_part(read, renderer, part, skip_invalid, invalid), {}
    steps = {s.id: plan(s.messages) for s in part}
    rendered = _render_part(read, renderer, part, skip_invalid, invalid,
                            lambda s: steps[s.id][0].context if len(steps[s.id]) > 1 else s.messages,
                            lambda s: s.messages if len(steps[s.id]) > 1 else None)
    return rendered, {s.id: len(steps[s.id]) for s, _out in rendered if len(steps[s.id]) > 1}


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
            {s.id: {name: got[s.id][name] for name in needed[s.id]} for s in keep})


def prepare(read: ReadResult, renderer: Renderer, settings: DatasetSettings, *, max_tokens: int, context: Context,
            max_samples: int | None, skip_invalid: bool = False,
            progress: Callable[[int], None] | None = None) -> Prepared:
    """Render ``read``'s samples in the settings' order and select them: valid, fitting the ``context``, and the
    first ``max_samples`` of that order (with --order random: a seeded random subset, not the file's first lines).

    ``--turns all``: a conversation of more than one turn is sent as its turn 0 (the workers render the later
    turns on the model's own answers), so its prompt and its context check are turn 0's; it is rendered whole
    as well, so a template that refuses a later turn's shape is found here (exit 2), not by a worker.

    A template kwargs mix (``settings.variants``): each prompt is rendered with the variant of each of its
    generations, and checked against the context with the longest."""
    prompts: dict[str, Prompt] = {}
    invalid, over_context, beyond = list(read.invalid), [], 0
    batch = 256
    samples = permute(read.samples, settings.order)
    variants = settings.variants
    for start in range(0, len(samples), batch):
        if max_samples is not None and len(prompts) >= max_samples:
            beyond += len(samples) - start
            break
        part = samples[start:start + batch]
        if variants is None:
            rendered, conversations = _render_batch(read, renderer, part, skip_invalid, invalid, settings.turns)
            by_variant = {s.id: {"": out} for s, out in rendered}
        else:
            rendered, conversations, by_variant = _render_variants(read, variants, part, skip_invalid, invalid,
                                                                   settings.turns)
        if progress is not None:
            progress(len(part))
        for i, (sample, _out) in enumerate(rendered):
            if max_samples is not None and len(prompts) >= max_samples:
                beyond += len(part) - i
                break
            prompt = Prompt(sample, {name: (array("i", o.input_ids), o.opens_think)
                                     for name, o in by_variant[sample.id].items()},
                            conversations.get(sample.id, 1))
            if prompt.length + max_tokens > context.tokens:
                over_context.append(sample.problem(
                    f"prompt of {prompt.length} tokens + --max-tokens {max_tokens} exceeds the context of "
                    f"{context.tokens} ({context.source})"))
                continue
            prompts[sample.id] = prompt
    return Prepared(read.name, read.path, settings, prompts, invalid, list(read.duplicates), over_context, beyond)


def tools_ignored(renderer: Renderer, prepared: Prepared) -> Problem | None:
    """The first selected sample with tools when the chat template ignores them (its prompt rendered with and
    without them gives the same ids: the model would never see a tool), else None. One sample stands for the
    dataset: whether a template renders ``tools`` does not depend on which."""
    sample = next((p.sample for p in prepared.prompts.values() if p.sample.tools), None)
    if sample is None:
        return None
    messages = first_turn(sample.messages) if prepared.prompts[sample.id].turns > 1 else sample.messages
    try:
        ignored = renderer.render(messages, sample.tools).input_ids == renderer.render(messages).input_ids
    except RenderError:  # rendered with its tools already; a template that needs tools is not ignoring them
        return None
    if not ignored:
        return None
    with_tools = sum(1 for p in prepared.prompts.values() if p.sample.tools)
    return sample.problem(f'the chat template ignores "tools": {with_tools} samples of {prepared.name} have tool '
                          "definitions that are not in their prompts (the model will not see them); use the "
                          "model's own tokenizer, whose template renders tools")


def resolve_parser(choice: str, tokenizer: Any, renderer: Renderer) -> str:
    """``--reasoning-parser``: the name given, or for ``auto`` the one the tokenizer and template point to.
    Raises UsageError (exit 2) naming the candidates when detection is ambiguous."""
    from producer.settings import AUTO, AmbiguousParser, detect, evidence
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


@dataclass(frozen=True)
class Inputs:
    """Everything a run (or a plan) needs from the files and the tokenizer, checked."""

    prepared: list[Prepared]
    renderer: Renderer
    settings: DatasetSettings  # every dataset's (``Prepared.settings``)
    context: Context  # what the prompts were checked against, and where it came from

    def conversation(self, vocab_size: int | None = None) -> ConversationPayload | None:
        """The chunk's ``conversation`` block (budget/record.py) when a dataset has multi-turn conversations:
        the renderer's fingerprint (its files go to Redis under it), the template kwargs, the context turn 0
        was checked against (``context``: the servers' once launch.py rechecked it), the parser's think markers when they are not the template's (Kimi), and the
        ``vocab_size`` the prompts were checked against (a later turn's ids are checked against it too)."""
        if not any(p.turns for p in self.prepared):
            return None
        from producer.settings import PARSER_MARKERS
        markers = PARSER_MARKERS[self.settings.reasoning_parser]
        think = self.renderer.think
        block: ConversationPayload = {
            "tokenizer": str(self.settings.stored["tokenizer"]),
            "chat_template_kwargs": dict(self.settings.chat_template_kwargs), "max_context": self.context.tokens,
            "open_markers": [markers.start, markers.end] if markers is not None and markers != think else None}
        if vocab_size is not None:
            block["vocab_size"] = vocab_size
        return block


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


def load_inputs(s: RunSettings, *, echo: Callable[[str], None], warn: Callable[[str], None]) -> Inputs:
    """Read, validate and render every file of ``produce run`` ``s``, every dataset with the settings ``resolve``
    makes of ``s`` once the tokenizer is read. Raises UsageError (exit 2) on any input problem."""
    from producer.inputs.reader import InputError, read_all
    from render.chat import load_tokenizer

    reading = progress_bar(None, "validating", show=s.show_progress, unit=" records")
    try:
        reads = read_all(list(s.files), s.skip_invalid, mapping=s.mapping, progress=reading.update)
    except InputError as exc:
        raise UsageError(str(exc)) from None
    finally:
        reading.close()
    for r in reads:
        for problem in r.invalid:
            warn(f"skipped {problem}")
        for problem in r.duplicates:
            echo(f"skipped {problem}")
    kwargs = dict(s.chat_template_kwargs)
    try:
        tok = load_tokenizer(s.tokenizer, s.chat_template)
        renderer = Renderer(tok, chat_template_kwargs=kwargs)
    except RenderError as exc:
        raise UsageError(str(exc)) from None
    from producer.settings import AUTO, PARSER_MARKERS
    parser = resolve_parser(s.reasoning_parser, tok, renderer)
    markers = PARSER_MARKERS[parser]
    opens_markers = markers if markers is not None and markers != renderer.think else None
    if opens_markers is not None:  # Kimi's ◁think▷: opens_think must look for those
        renderer = Renderer(tok, chat_template_kwargs=kwargs, opens_markers=opens_markers)
    echo(f"reasoning parser: {parser}" + (" (detected from the tokenizer)" if s.reasoning_parser == AUTO else ""))
    variants = None
    if s.template_mix is not None:
        clash = sorted(set(s.template_mix.keys) & set(kwargs))
        if clash:
            raise UsageError(f"--template-kwargs-mix and --chat-template-kwargs both set {', '.join(clash)}: "
                             "give each key in one of them")
        variants = Variants(tok, kwargs, s.template_mix, s.generations, opens_markers=opens_markers)
        echo(s.template_mix.describe())
    settings = resolve(s, renderer, parser, variants)
    context = choose_context(s.max_context, tok)
    check_max_tokens(s.max_tokens, context)
    echo(f"context: {context.tokens:,} tokens ({context.source})")
    bar = progress_bar(sum(len(r.samples) for r in reads), "rendering", show=s.show_progress)
    try:
        prepared = [prepare(r, renderer, settings, max_tokens=s.max_tokens, context=context,
                            max_samples=s.max_samples, skip_invalid=s.skip_invalid, progress=bar.update)
                    for r in reads]
    except RenderError as exc:
        raise UsageError(str(exc)) from None
    finally:
        bar.close()
    for p in prepared:
        for problem in p.over_context:
            echo(f"skipped {problem}")
        ignored = tools_ignored(renderer, p)
        if ignored is not None:
            warn(str(ignored))
        conversations = (f"; turns: all, {p.conversations} multi-turn conversations ({p.turns_total} requests at "
                         "most)" if settings.turns == ALL else "")
        n = p.settings.generations.n  # the conversations and requests below count every generation: so do samples
        prompts = f"{len(p.prompts)} prompts x {n} generations, " if n > 1 else ""
        echo(f"{p.name}: {p.selected} samples ready ({prompts}{p.prompt_tokens} prompt tokens), "
             f"{len(p.invalid)} invalid, {len(p.duplicates)} duplicate ids, {len(p.over_context)} over context; "
             f"order: {settings.order.describe()}{conversations}")
    return Inputs(prepared, renderer, settings, context)
