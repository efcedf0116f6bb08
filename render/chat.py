"""Chat prompts -> `input_ids`, with the model's own chat template.

`produce` renders every prompt (a conversation's turn 0) here and sends token ids (not text) to SGLang, so the
server never applies a template of its own and the ids are exactly what the budget is counted against. A GPU
worker renders a conversation's later turns with this same code (docs/multiturn.md, "Where rendering happens"):
that is why it lives in render/, which producer/ and worker/ may both import, and not in producer/. transformers
is imported only inside `load_tokenizer`; a worker imports this module only when a run needs it. Rules kept:

- Tokenizers come from a local directory only (`local_files_only=True`), or a hub id's snapshot in the local
  Hugging Face cache: there is no model hub to reach.
- The ids come straight from `apply_chat_template(tokenize=True)`, which encodes the rendered text with
  `add_special_tokens=False`. Rendering to text and encoding it again would add a second BOS on tokenizers whose
  template already writes one (Llama, Gemma, the demo tokenizer).
- A record's own tool definitions go to the template as ``tools=`` (its own tool syntax renders them), per call:
  they override a ``tools`` of the run's chat_template_kwargs, and are not in the fingerprint (they are the
  data, not the renderer).
- A run's ``--chat-template FILE`` (`ChatTemplate`) replaces the tokenizer's template(s) wherever the run's
  tokenizer is loaded (`load_tokenizer`): the producer, the workers (render/tokfiles.py packs it as the
  directory's ``chat_template.jinja``) and export's row check. It is then the tokenizer's ``chat_template``, so
  the fingerprint covers it like a template of the tokenizer's own.
- Everything that does not depend on the messages (template kwargs, think markers, the fingerprint) is
  computed once per `Renderer`, because 100,000 prompts go through `render`.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal, Mapping, Sequence

from render import RenderError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DEFAULT_THINK_START: Final = "<think>"
DEFAULT_THINK_END: Final = "</think>"
# Enough tokens to hold the generation prompt's tail ("<|im_start|>assistant\n<think>\n" is 4-6 tokens).
_TAIL_TOKENS: Final = 16
# apply_chat_template arguments that the renderer owns: a kwarg with one of these names would change the shape of
# the result (text, dict, tensors, padding) or clash with our own call.
_RESERVED_KWARGS: Final = frozenset(
    {
        "conversation",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "return_dict",
        "return_tensors",
        "return_assistant_tokens_mask",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
    }
)
#: A record's tool definitions (producer/inputs/records.py), as apply_chat_template takes them; None or empty: none.
Tools = Sequence[Mapping[str, Any]] | None
# Bump when the way ids are produced changes, so runs stored by an older renderer are refused.
_FINGERPRINT_VERSION: Final = "budgetq-render-1"


@dataclass(frozen=True)
class ThinkMarkers:
    """The tags a reasoning model wraps its thinking in."""

    start: str = DEFAULT_THINK_START
    end: str = DEFAULT_THINK_END


@dataclass(frozen=True)
class Rendered:
    """One rendered prompt."""

    input_ids: list[int]
    # The prompt ends inside an unclosed thinking tag (a thinking model's generation prompt ends with "<think>\n"),
    # so the completion holds only "...</think>answer" and its parser must not look for the opening tag.
    opens_think: bool


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template read from a file (``--chat-template``), used instead of the tokenizer's own, as
    SGLang's ``--chat-template`` is: for a tokenizer whose template is wrong or missing."""

    path: str
    text: str

    @property
    def digest(self) -> str:
        """sha256 hex of the template text: what run.json keeps, so a rerun or an export can tell the file changed."""
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def read_chat_template(path: str | Path) -> ChatTemplate:
    """The template in file ``path`` (made absolute). Raises RenderError naming the file when it is missing,
    unreadable, not UTF-8 or empty; `load_tokenizer` compiles it."""
    file = Path(path).expanduser()
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RenderError(f"chat template file {path}: no such file") from None
    except UnicodeDecodeError as exc:
        raise RenderError(f"chat template file {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise RenderError(f"chat template file {path}: cannot read it ({exc.strerror or exc})") from None
    if not text.strip():
        raise RenderError(f"chat template file {path}: the file is empty")
    return ChatTemplate(str(file.resolve()), text)


def _use_template(tokenizer: PreTrainedTokenizerBase, template: ChatTemplate) -> None:
    """Make ``template`` the tokenizer's only chat template, compiled now by transformers' own Jinja environment
    (its extensions, its sandbox), so a syntax error is an error naming the file before any prompt is rendered."""
    import jinja2  # here, not at import: producer/settings.py imports ThinkMarkers, and `produce --help` no Jinja

    tokenizer.chat_template = template.text
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    except jinja2.TemplateSyntaxError as exc:
        raise RenderError(f"chat template file {template.path}: not a valid Jinja template: {exc.message} "
                          f"(line {exc.lineno})") from None
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError):
        pass  # it compiled: refusing this one message (raise_exception, a system turn required) is the data's business


def load_tokenizer(path: str | Path, chat_template: ChatTemplate | None = None) -> PreTrainedTokenizerBase:
    """Load the tokenizer in directory `path` (or, for a hub id such as ``Qwen/Qwen3-8B``, its snapshot in the
    local Hugging Face cache: render.modeldir), never from a network hub; with ``chat_template``, that template
    replaces the tokenizer's own.

    Raises RenderError naming the path when the directory is missing, holds no tokenizer, or the tokenizer has no
    chat template (a base model's tokenizer: the prompts could not be rendered as the model was trained), or
    naming the template file when it is not valid Jinja.
    """
    from render.modeldir import ModelDirError, resolve_tokenizer

    try:
        # Checked first: AutoTokenizer would take a missing directory for a hub repo id and try the network.
        directory = resolve_tokenizer(path)
    except ModelDirError as exc:
        raise RenderError(str(exc)) from None
    # Best effort for whatever imports transformers after us; local_files_only below is the real guarantee.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # "PyTorch was not found": we need no models
    from transformers import AutoTokenizer

    try:
        tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        reason = " ".join(str(exc).split())  # transformers' messages span lines
        raise RenderError(f"cannot load a tokenizer from {directory}: {reason}") from exc
    if chat_template is not None:
        _use_template(tokenizer, chat_template)
    if not getattr(tokenizer, "chat_template", None):
        raise RenderError(f"the tokenizer in {directory} has no chat_template: prompts cannot be rendered (give "
                          "one with --chat-template FILE)")
    return tokenizer


def _template_texts(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        return [template]
    if isinstance(template, Mapping):  # named templates ("default", "tool_use", ...)
        return [str(text) for text in template.values()]
    return []


def detect_think_markers(tokenizer: PreTrainedTokenizerBase) -> ThinkMarkers | None:
    """The "<think>"/"</think>" markers when the model knows them, else None.

    Both must be tokens of the vocabulary (Qwen3, DeepSeek-R1 add them) or appear in the chat template.
    """
    markers = ThinkMarkers()
    vocab = tokenizer.get_vocab()  # includes the added tokens
    if markers.start in vocab and markers.end in vocab:
        return markers
    for text in _template_texts(tokenizer):
        if markers.start in text and markers.end in text:
            return markers
    return None


def default_max_context(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The tokenizer's `model_max_length` when it is a real context size, else None (unknown: transformers'
    int(1e30) when tokenizer_config.json leaves it unset)."""
    from render.modeldir import sane_context
    return sane_context(getattr(tokenizer, "model_max_length", None))


def _canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def _vocabulary_digest(tokenizer: PreTrainedTokenizerBase) -> str:
    """A digest of everything that maps text to ids: model, merges, added tokens, normalizer, pre-tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        state = json.loads(backend.to_str())
        # Runtime settings that transformers changes on calls; they don't change our ids (we never pad or truncate).
        state.pop("truncation", None)
        state.pop("padding", None)
        payload = _canonical_json(state)
    else:  # a slow (Python) tokenizer: its vocabulary is the best available proxy
        payload = _canonical_json(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def _checked(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    # A list of lists would be taken as a batch by apply_chat_template and give nested lists back.
    if isinstance(messages, (str, bytes)) or not messages or not all(isinstance(m, Mapping) for m in messages):
        raise RenderError("messages must be a non-empty list of message objects")
    return [_with_object_arguments(m) for m in messages]


def _with_object_arguments(message: Mapping[str, Any]) -> dict[str, Any]:
    """An assistant message's tool-call ``arguments`` as the JSON object they encode, as SGLang's chat serving
    gives them to the template (sglang/srt/entrypoints/openai/serving_chat.py
    ``normalize_assistant_tool_call_arguments``): templates such as GLM-4.5's iterate them as a mapping and
    refuse a string, and Qwen3's renders an object with ``tojson``. A string that is not a JSON object stays as
    it is (SGLang refuses such a request; here the template decides). The caller's messages are not changed."""
    out = message if type(message) is dict else dict(message)
    calls = out.get("tool_calls")
    if out.get("role") != "assistant" or not isinstance(calls, list):
        return out
    fixed = []
    changed = False
    for call in calls:
        fn = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(fn, Mapping) and isinstance(fn.get("arguments"), str):
            try:
                args = json.loads(fn["arguments"])
            except ValueError:
                args = None
            if isinstance(args, dict):
                call = {**call, "function": {**fn, "arguments": args}}
                changed = True
        fixed.append(call)
    return {**out, "tool_calls": fixed} if changed else out


class Renderer:
    """Renders message lists to prompt ids with one tokenizer and one set of chat-template kwargs.

    `think` is the pair of markers used to tell whether a prompt opens a thinking block: "auto" (the default) asks
    `detect_think_markers`, None declares a model that does not think.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        think: ThinkMarkers | None | Literal["auto"] = "auto",
        opens_markers: ThinkMarkers | None = None,
    ) -> None:
        kwargs = dict(chat_template_kwargs or {})
        reserved = sorted(_RESERVED_KWARGS.intersection(kwargs))
        if reserved:
            raise RenderError(f"chat_template_kwargs may not set {', '.join(reserved)}: the renderer sets them")
        try:
            # Top-level keys sorted (they are keyword arguments), nested order kept: the template may render a
            # tool's schema in the order it was given, so two orders are two different prompts.
            self._kwargs_json = json.dumps(
                {key: kwargs[key] for key in sorted(kwargs)}, ensure_ascii=False, separators=(",", ":")
            )
        except (TypeError, ValueError) as exc:
            raise RenderError(f"chat_template_kwargs must be JSON values: {exc}") from exc
        if not _template_texts(tokenizer):
            raise RenderError("the tokenizer has no chat_template: prompts cannot be rendered")
        # A JSON copy: later changes to the caller's objects must not change what this renderer does.
        self._kwargs: dict[str, Any] = json.loads(self._kwargs_json)
        self._tokenizer = tokenizer
        self._think = detect_think_markers(tokenizer) if isinstance(think, str) else think
        # The markers `opens_think` looks for when the run's reasoning parser uses others than `think` (Kimi's
        # ◁think▷). Not in the fingerprint: the run's settings name the parser, which names the markers.
        self._open_markers = opens_markers or self._think
        self._fingerprint: str | None = None

    @property
    def tokenizer(self) -> Any:
        """The tokenizer it renders with (the run's)."""
        return self._tokenizer

    @property
    def think(self) -> ThinkMarkers | None:
        """The markers in use (None: the model does not think)."""
        return self._think

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Tools = None, *,
               generation_prompt: bool = True) -> Rendered:
        """Render one conversation to ids, with the generation prompt (a prompt) or without (a conversation that
        ends with an assistant turn, as a trainer renders it); ``tools`` (the record's tool definitions, None:
        none) go to the template. Template errors raise RenderError."""
        return self._rendered(self._apply(_checked(messages), tools, generation_prompt))

    def check(self, messages: Sequence[Mapping[str, Any]], tools: Tools = None) -> None:
        """Raise what `render` (with the generation prompt) would raise for ``messages``, without making ids:
        `check_many` for one conversation."""
        self._apply(_checked(messages), tools, tokenize=False)

    def render_many(self, conversations: Sequence[Sequence[Mapping[str, Any]]],
                    tools: Sequence[Tools] | None = None) -> list[Rendered]:
        """Render several conversations in one call: the same ids as `render`, faster on several cores.
        ``tools``: each conversation's tool definitions (None: none has any).

        The tokenizers library encodes a batch in parallel (about 1.7x on two cores); apply_chat_template takes
        one ``tools`` per batch, so the conversations are batched by their tools. When one conversation fails,
        it is rendered one by one, so the RenderError names the index of the first conversation at fault.
        """
        return [self._rendered(row) for row in self._batched(conversations, tools, tokenize=True)]

    def check_many(self, conversations: Sequence[Sequence[Mapping[str, Any]]],
                   tools: Sequence[Tools] | None = None) -> None:
        """Raise what `render_many` would raise for these conversations, without making their ids: the chat
        template is rendered to text only. A template error (``raise_exception``, an undefined name, content of
        the wrong type) happens while the text is made; encoding text cannot fail, and is ~4/5 of a render's
        time (docs/performance.md, figure 4). For conversations whose ids are never sent (``produce --turns
        all`` checks each conversation whole, then sends its turn 0)."""
        self._batched(conversations, tools, tokenize=False)

    def _batched(self, conversations: Sequence[Sequence[Mapping[str, Any]]], tools: Sequence[Tools] | None,
                 *, tokenize: bool) -> list[Any]:
        """apply_chat_template's rows (ids, or texts without ``tokenize``) in the order given, one call per set
        of tools; on a RenderError, the conversations one by one, raising for the first at fault with its index."""
        if not conversations:
            return []
        batch = [_checked(messages) for messages in conversations]
        each: Sequence[Tools] = tools if tools is not None else [None] * len(batch)
        groups: dict[str, list[int]] = {}
        for index, one in enumerate(each):
            # Key order kept: a template renders a schema in the order given, so two orders are two prompts.
            key = "" if not one else json.dumps(one, ensure_ascii=False, separators=(",", ":"), default=repr)
            groups.setdefault(key, []).append(index)
        rows: list[Any] = [None] * len(batch)
        try:
            for indexes in groups.values():
                out = self._apply([batch[i] for i in indexes], each[indexes[0]], tokenize=tokenize)
                for i, row in zip(indexes, out if isinstance(out, list) else list(out["input_ids"]), strict=True):
                    rows[i] = row
        except RenderError:
            for index, messages in enumerate(batch):
                try:
                    self._apply(messages, each[index], tokenize=tokenize)
                except RenderError as exc:
                    raise RenderError(f"conversation {index}: {exc}", index=index) from exc
            raise
        return rows

    def _apply(self, conversation: list[dict[str, Any]] | list[list[dict[str, Any]]], tools: Tools,
               generation_prompt: bool = True, *, tokenize: bool = True) -> Any:
        import jinja2  # loaded with transformers already; see _use_template

        kwargs = self._kwargs if not tools else {**self._kwargs, "tools": [dict(t) for t in tools]}
        try:
            return self._tokenizer.apply_chat_template(
                conversation, add_generation_prompt=generation_prompt, tokenize=tokenize, return_dict=False,
                **kwargs
            )
        except jinja2.TemplateError as exc:  # raise_exception() in the template, undefined names, syntax errors
            raise RenderError(f"chat template error: {exc}") from exc
        except (TypeError, ValueError) as exc:  # e.g. content of the wrong type concatenated in the template
            raise RenderError(f"cannot render messages: {exc}") from exc

    def _rendered(self, out: Any) -> Rendered:
        # return_dict=False gives list[int] in transformers 5; other tokenizers may still give a mapping.
        ids = out if type(out) is list else list(out["input_ids"] if isinstance(out, Mapping) else out)
        if ids and not isinstance(ids[0], int):
            raise RenderError(f"the tokenizer returned {type(ids[0]).__name__} items, not token ids")
        return Rendered(input_ids=ids, opens_think=self._opens_think(ids))

    def _opens_think(self, ids: list[int]) -> bool:
        markers = self._open_markers
        if markers is None:
            return False
        # Only the tail: decoding a whole 30K-token prompt per sample would cost more than rendering it.
        tail_ids = ids[-_TAIL_TOKENS:]
        decoded = self._tokenizer.decode(tail_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        tail = decoded if isinstance(decoded, str) else "".join(decoded)
        return tail.rfind(markers.start) > tail.rfind(markers.end)

    def fingerprint(self) -> str:
        """sha256 hex over all that decides the ids and their meaning, to refuse a rerun with another tokenizer.

        Covers the chat template(s), the tokenizer's vocabulary and pipeline, the special tokens, the think markers
        and the chat_template_kwargs. Computed once (serializing a 150K vocabulary takes a moment).
        """
        if self._fingerprint is None:
            tok = self._tokenizer
            parts = {
                "version": _FINGERPRINT_VERSION,
                "chat_template": getattr(tok, "chat_template", None),
                "vocabulary": _vocabulary_digest(tok),
                "special_tokens": list(zip(tok.all_special_tokens, tok.all_special_ids, strict=True)),
                "special_tokens_map": tok.special_tokens_map,
                "think": None if self._think is None else [self._think.start, self._think.end],
                "chat_template_kwargs": self._kwargs_json,
            }
            self._fingerprint = hashlib.sha256(_canonical_json(parts).encode("utf-8")).hexdigest()
        return self._fingerprint

