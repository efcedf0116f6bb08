"""Rendering chat prompts to token ids, shared by the producer and the GPU workers (docs/architecture.md).

producer/ renders turn 0 of every conversation; a worker renders a conversation's later turns
(docs/multiturn.md). Both import this package and never each other. Nothing here imports transformers at module
level, and this ``__init__`` imports nothing, so a worker that never renders never loads it.

`RenderError` is defined here, not in render/chat.py (which raises it and re-exports it), so that a worker can
catch it by name around a conversation's later turns (worker/turns.py) without importing chat.py and jinja2
before it renders anything.
"""


class RenderError(Exception):
    """A user error (bad tokenizer directory, template, messages or kwargs), with a message fit to show as is.

    `index` is set by `Renderer.render_many`: the position of the failing conversation in the batch, so the caller
    can name the file line at fault.
    """

    def __init__(self, message: str, *, index: int | None = None) -> None:
        super().__init__(message)
        self.index = index
