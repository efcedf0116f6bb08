"""Rendering chat prompts to token ids, shared by the producer and the GPU workers (docs/architecture.md).

producer/ renders turn 0 of every conversation; a worker renders a conversation's later turns
(docs/multiturn.md). Both import this package and never each other. Nothing here imports transformers at module
level, and this ``__init__`` imports nothing, so a worker that never renders never loads it.
"""
