"""What the attached producer is told (``RunOptions``) and what it knows of each dataset (``DatasetRun``).

A ``DatasetRun`` is rebuilt from Redis and the output files by every attach (producer/session/attach.py), kept up to date by
the loop (producer/session/loop.py) and read by the report (producer/session/report.py). A killed ``produce`` loses only what it
counts in memory: a sample's reclaims (``MAX_RECLAIMS``, counted from 0 again) and when it saw a chunk queued.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from budget.mix import Mix
from budget.payload import ConversationPayload
from producer.generations import Variants
from producer.prepare import Prepared
from producer.results import ResultsFile
from producer.session.enqueue import JobSettings
from producer.settings import Budget
from render.chat import ChatTemplate


@dataclass(frozen=True)
class RunOptions:
    """What the attached producer is told: where it writes, each dataset's budget and mode as given, how it sizes
    and paces its chunks. What a dataset is rendered, sent and stored with is its ``Prepared.settings``."""

    out_dir: Path
    budgets: Mapping[str, Budget | None]  # explicit --budget per dataset (or UNLIMITED); None: keep the stored one
    modes: Mapping[str, str | None] = field(default_factory=dict)  # --budget-mode; None: stored, else predict
    expect_mean: float | None = None  # prior completion length for predict before results arrive
    chunk_size: int = 256
    queue_depth: int = 16
    margin: float = 1.25  # just-in-time: hold this many times the samples the remaining budget needs
    new_run: bool = False
    job: JobSettings = field(default_factory=JobSettings)
    poll_s: float = 0.2
    progress_s: float = 5.0
    show_progress: bool = False  # a bar on stderr while --detach enqueues (produce: a terminal and not --quiet)
    #: ``--turns all``: what a chunk holding a multi-turn sample tells its worker (budget/payload.py), and the
    #: --tokenizer whose files are stored in Redis for the workers to render later turns with (attach, once), with
    #: the --chat-template as their chat_template.jinja; both written in run.json (``tokenizer_path``,
    #: ``chat_template_path``) for ``produce export``.
    conversation: ConversationPayload | None = None
    tokenizer: str | None = None
    chat_template: ChatTemplate | None = None
    #: --budget TOTAL --mix ...: the mix as given (budget/mix.py); None: no --mix (a stored mix still applies).
    mix: Mix | None = None
    #: --no-mix-pacing: let a mix's members progress at whatever rate their chunks are pulled (for comparison).
    mix_pacing: bool = True
    #: --deadline / --for, unix seconds (None: keep the stored one, if any).
    deadline: float | None = None
    #: --template-kwargs-mix: the renderer of each drawn combination (producer/generations.py Variants); None: no mix.
    variants: Variants | None = None


@dataclass
class DatasetRun:
    prepared: Prepared
    out: ResultsFile
    lock_token: str
    todo: deque[str]
    chunk_samples: dict[str, list[str]]
    done: set[str]
    failed: dict[str, dict[str, Any]] = field(default_factory=dict)
    reclaims: dict[str, int] = field(default_factory=dict)
    status: str = "open"
    closed_by: str = ""  # "deadline" when the deadline closed it (the admit script's meta closed_by)
    deadline: float | None = None  # its deadline as last read (the meta's deadline, unix s); None: none
    used: int = 0
    budget: int | None = None
    finished: bool = False
    queued_seen: dict[str, float] = field(default_factory=dict)
    #: The dataset's stats hash as last read (``DatasetState.stats``): its 10-second token buckets give the progress
    #: line's tok/s, the one ``produce status`` shows (producer/ops/status.py ``tokens_per_second``).
    stats: dict[str, str] = field(default_factory=dict)
    enqueued_samples: int = 0
    #: Conversations whose record on disk ended ``stopped_by: failed`` and that this run carries on (``reopen``):
    #: not done until their new record is collected, though the file holds an id for them.
    resuming: set[str] = field(default_factory=set)
    turns_committed: int = 0  # the stats' ``turns`` (commit_turn): turns of multi-turn conversations committed
    #: Closed: started conversations in the to-do list are looked for once (then only samples given back), since
    #: no worker may resume them; ``stranded`` are the ones a worker was still committing to when looked at.
    reclaim_turns: dict[str, int] = field(default_factory=dict)  # a conversation's turns at its last reclaim
    stranded_checked: bool = False
    stranded: set[str] = field(default_factory=set)

    @property
    def name(self) -> str:
        return self.prepared.name
