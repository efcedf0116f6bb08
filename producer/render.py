"""The producer's name for render.chat (the rendering moved to render/, which workers may import too).

Re-exported so that code and tests importing ``producer.render`` keep working unchanged.
"""
from __future__ import annotations

from render.chat import (
    DEFAULT_THINK_END,
    DEFAULT_THINK_START,
    Rendered,
    RenderError,
    Renderer,
    ThinkMarkers,
    default_max_context,
    detect_think_markers,
    load_tokenizer,
)

__all__ = ["DEFAULT_THINK_END", "DEFAULT_THINK_START", "Rendered", "RenderError", "Renderer", "ThinkMarkers",
           "default_max_context", "detect_think_markers", "load_tokenizer"]
