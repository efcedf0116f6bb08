"""Every Redis key budgetq reads or writes, named in one place.

All of a dataset's keys carry the dataset name in braces (``bq:ds:{name}:...``): in Redis Cluster the braces
are a hash tag, so every key one of our Lua scripts touches for one dataset lives in one slot. Dataset names
are validated by the producer (letters, digits, ``_``, ``-``) before they ever reach this module, so a name
can never forge another dataset's key, an RQ job id or a path outside ``--out``.

| key                         | type   | written by               | what                                              |
| --------------------------- | ------ | ------------------------ | ------------------------------------------------- |
| ``bq:datasets``             | set    | producer                 | every dataset name known to this Redis            |
| ``bq:epoch``                | string | producer                 | this Redis' lifetime id (lost state detection)    |
| ``bq:server_info``          | hash   | worker (serverinfo)      | "host url" -> JSON: SGLang's /get_server_info,    |
|                             |        |                          | SERVER_INFO_KEYS only; expires with the workers   |
| ``bq:server_health``       | hash   | worker (health)          | RQ worker name -> JSON: the servers it finds down |
|                             |        |                          | (budget/serverinfo.py); rewritten every 10 s   |
|                             |        |                          | while any is down, deleted when all answer;       |
|                             |        |                          | entries older than 30 s are dead workers': pruned |
| ``bq:server_load``          | hash   | worker (loadreport)      | RQ worker name -> JSON: per server its requests   |
|                             |        |                          | in flight, window, max_running_requests, tokens/s |
|                             |        |                          | and last error (budget/serverinfo.py);         |
|                             |        |                          | rewritten every 5 s, deleted at stop; entries     |
|                             |        |                          | older than 30 s are dead workers': pruned         |
| ``bq:window``               | zset   | worker (window)          | "<server>SEP<worker id>" -> Redis time (ms) when  |
|                             |        |                          | it lapses: the live workers with an automatic     |
|                             |        |                          | window on each SGLang server (budget/window.py);  |
|                             |        |                          | renewed every second, lapsed after 10 s; expires  |
|                             |        |                          | with the last worker                              |
| ``bq:tok:{fp}``             | hash   | producer (runstate)      | file name -> zlib bytes: the tokenizer files of   |
|                             |        |                          | the run whose Renderer fingerprint is fp, for the |
|                             |        |                          | workers that render later turns; HSETNX, never    |
|                             |        |                          | changed (docs/multiturn.md)                       |
| ``bq:mix:{id}``             | hash   | producer (MixStore)      | a mix (docs/mix.md): ``total``, ``weight:<name>``,|
|                             |        |                          | ``dry:<name>`` (tokens when it ran dry), ``given``|
|                             |        |                          | (the last command's mix); id = members, sorted,   |
|                             |        |                          | joined by ","                                     |
| ``bq:ds:{n}``               | hash   | producer, scripts        | the dataset's record: META_FIELDS below           |
| ``bq:ds:{n}:used``          | string | ``commit`` script        | completion tokens committed: THE budget counter   |
| ``bq:ds:{n}:done``          | hash   | ``commit`` script        | sample id -> completion tokens; exactly-once guard|
| ``bq:ds:{n}:pending``       | hash   | producer, scripts        | sample id -> chunk id that holds it               |
| ``bq:ds:{n}:chunks``        | zset   | producer, worker         | live chunk ids; score = lease deadline (ms) while |
|                             |        |                          | running, +inf while queued                        |
| ``bq:ds:{n}:seq``           | string | producer                 | chunk counter: chunk (= RQ job) ids never repeat  |
| ``bq:ds:{n}:results``       | stream | ``commit`` script        | committed results not yet written to disk         |
| ``bq:ds:{n}:failed``        | hash   | ``fail`` script          | sample id -> JSON reason, after every attempt     |
| ``bq:ds:{n}:collector``     | string | producer                 | lock: the one ``produce`` collecting this dataset;|
|                             |        |                          | value ``host:pid:uuid`` (who holds it, for the    |
|                             |        |                          | refusal's message and a dead holder's takeover)   |
| ``bq:ds:{n}:resv``          | hash   | admit/commit, worker     | running chunk id -> tokens its requests reserve   |
| ``bq:ds:{n}:inflight``      | hash   | admit/commit             | running chunk id -> requests in flight            |
| ``bq:ds:{n}:lengths``       | list   | ``commit`` script        | the last 4096 completion lengths (predict's model)|
| ``bq:ds:{n}:lengths:{j}``   | list   | ``commit_turn`` script   | the last 4096 lengths of conversations' turn j    |
|                             |        |                          | (j = 0, 1, 2; 3 = the fourth turn and later):     |
|                             |        |                          | predict's per-turn model                          |
| ``bq:ds:{n}:stats``         | hash   | ``commit`` script        | finish reasons, late commits, tokens per 10 s;    |
|                             |        | (``end_conversation``:   | ``offered:{j}``/``reached:{j}``: ended            |
|                             |        | offered/reached)         | conversations that could go on to / reached turn j|
| ``bq:ds:{n}:progress``      | hash   | worker (refresh_chunk)   | running chunk id -> its requests' progress (JSON) |
| ``bq:ds:{n}:discarded``     | list   | ``discard`` script       | chunk ids out of the queue whose RQ job hashes    |
|                             |        |                          | ``mark_discarded`` has not yet marked canceled    |
| ``bq:ds:{n}:turns``         | hash   | ``commit_turn``,         | turn_field(sample, turn) -> completion tokens: a  |
|                             |        | ``reopen``; deleted by   | turn's exactly-once guard (docs/multiturn.md);    |
|                             |        | ``end_conversation``,    | sum = tokens committed, not yet in a record       |
|                             |        | ``reconcile_turns``      |                                                   |
| ``bq:ds:{n}:turnrec``       | hash   | same as ``turns``        | turn_field -> the turn's record JSON, kept until  |
|                             |        |                          | its conversation is written                       |
| ``bq:ds:{n}:convs``         | hash   | same as ``turns``        | sample -> turns committed: started conversations  |
|                             |        |                          | and the turn each resumes at                      |

The fields of ``bq:ds:{n}`` (META_FIELDS; a field missing means its default):

| field              | written by                              | what                                                 |
| ------------------ | --------------------------------------- | ---------------------------------------------------- |
| ``name``           | producer (RunState.register)            | the dataset name                                     |
| ``settings``       | producer (RunState.register)            | JSON of the run's fingerprinted settings (tokenizer, |
|                    |                                         | template, sampling): a rerun with others is refused  |
| ``queue``          | producer (RunState.register)            | the RQ queue its chunks go to                        |
| ``created_at``     | producer (RunState.register, HSETNX)    | unix time of the first ``produce`` of this run       |
| ``budget``         | ``set_budget`` script                   | completion tokens allowed; '' = unlimited            |
| ``status``         | ``set_budget``, ``commit``, ``admit``   | open / closed; unset: never set up                   |
|                    | (strict), ``uncommit`` (reopens),       |                                                      |
|                    | ``close`` (--new-run)                   |                                                      |
| ``closed_at``      | ``commit``/``admit``/``reconcile``      | Redis TIME (``s.us``) when it last closed            |
|                    | (close_if_spent), ``close``             |                                                      |
| ``mode``           | producer (Ledger.set_mode)              | drain / predict / strict; unset: drain               |
| ``max_new_tokens`` | producer (Ledger.set_mode)              | the request cap: strict's reservation and closing    |
| ``prior_mean``     | producer (Ledger.set_prior)             | predict's expected length before results arrive      |
| ``committed``      | ``commit``, ``end_conversation``        | responses (and conversations) committed (not reset   |
|                    | (HINCRBY)                               | by uncommit)                                         |
| ``discarded_chunks``| ``discard`` script (HINCRBY)           | queued chunks taken out of the queue after closing   |
| ``selected``       | producer (RunState.set_progress)        | samples the attached produce selected (for status)   |
| ``todo``           | producer (RunState.set_progress)        | of those, not yet handed to a chunk (status shows    |
|                    |                                         | them as discarded once the dataset closed)           |
| ``cut``            | ``set_budget`` (set when the budget is  | 1: the budget was lowered to <= used; admit_turn     |
|                    | lowered to <= used, deleted when it is  | stops every started conversation (docs/multiturn.md) |
|                    | removed or set above used)              | unset: not cut                                       |
| ``out_dir``        | producer (RunState.register)            | the absolute, resolved --out of the run's last       |
|                    |                                         | ``produce``: a rerun whose --out resolves elsewhere  |
|                    |                                         | is refused (it would regenerate what is on disk)     |
| ``mix``            | producer (MixStore)                     | the id of the mix the dataset belongs to; unset: none|
| ``deadline``       | producer (Ledger.set_deadline)          | unix ms by which requests must end: ``admit`` closes |
|                    |                                         | the dataset at the first that could not; unset: none |
| ``closed_by``      | ``admit`` (past_deadline)               | ``deadline`` when the deadline closed the dataset    |
| ``run_budget``     | producer (RunState.set_run_budget)      | the --budget the last ``produce`` that gave one gave |
|                    |                                         | ('' = unlimited): a rerun giving it again keeps a    |
|                    |                                         | budget ``produce budget`` set since; unset: none     |

Who may send commands on these keys: budget/ alone (ledger.py and its scripts, runstate.py, serverinfo.py,
window.py).
producer/, render/, worker/ and demo/ call those and never name a key; tests/redis/test_key_ownership.py enforces it. RQ's keys
are RQ's: read or written through RQ's API, or by our scripts where a decision needs them (below).

RQ's own keys that our scripts touch (queue list, job hashes, canceled registry) are derived here from RQ's
documented layout, so a change of RQ's layout is a change of this module only.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

PREFIX = "bq:"
DATASETS = PREFIX + "datasets"
#: A random id set once per Redis lifetime (SET NX): an attached producer that finds it gone or changed knows
#: Redis lost its state (restarted empty, or restored from another snapshot) and stops instead of carrying on.
EPOCH = PREFIX + "epoch"
#: What each worker's SGLang servers say about themselves (budget/serverinfo.py): field ``"<worker host> <url>"``,
#: value JSON of SERVER_INFO_KEYS plus when it was fetched. Never an API key: only the listed keys are kept.
SERVER_INFO = PREFIX + "server_info"
#: Which servers each worker finds down (budget/serverinfo.py): field = the RQ worker's name, value = JSON.
SERVER_HEALTH = PREFIX + "server_health"
#: What each worker does with each of its SGLang servers (budget/serverinfo.py): field = the RQ worker's
#: name, value = JSON; for ``produce servers`` and ``produce metrics``.
SERVER_LOAD = PREFIX + "server_load"
#: Which workers share each SGLang server, for their automatic windows (budget/window.py): member
#: ``"<server>SEP<worker id>"``, score = when that registration lapses (Redis' clock, ms).
WINDOW = PREFIX + "window"


def mix(mix_id: str) -> str:
    """The hash of the mix whose members are ``mix_id`` (budget/ledger.py ``mix_id``: names sorted, joined by ",")."""
    return f"{PREFIX}mix:{{{mix_id}}}"


def tokenizer_files(fingerprint: str) -> str:
    """The hash of a run's tokenizer files (budget/runstate.py), by its Renderer fingerprint: content-addressed,
    so runs with one tokenizer and template share it. Only a sha256 hex digest is accepted, so no value can name
    another key."""
    if len(fingerprint) != 64 or fingerprint.strip("0123456789abcdef"):
        raise ValueError(f"a tokenizer fingerprint is 64 lowercase hex digits, not {fingerprint!r}")
    return f"{PREFIX}tok:{fingerprint}"

#: Every field of a dataset's hash (``DatasetKeys.meta``), documented in the table above (the one table of
#: them); tests check that a run writes no other.
META_FIELDS = ("name", "settings", "queue", "created_at", "budget", "status", "closed_at", "mode", "max_new_tokens",
               "prior_mean", "committed", "discarded_chunks", "selected", "todo", "cut", "out_dir", "run_budget",
               "mix", "deadline", "closed_by")

#: The one RQ queue that every dataset shares; workers listen on it (``worker.settings.QUEUES``).
QUEUE_NAME = "budgetq"

# RQ 3.x key layout (rq/queue.py, rq/job.py, rq/registry.py).
RQ_QUEUE = "rq:queue:" + QUEUE_NAME
#: Where RQ 3 moves a job it dequeues (BLMOVE) until the worker marks it started (rq/intermediate_queue.py).
RQ_INTERMEDIATE = RQ_QUEUE + ":intermediate"
RQ_JOB_PREFIX = "rq:job:"
RQ_CANCELED = "rq:canceled:" + QUEUE_NAME


#: A dataset's name is part of its Redis keys (inside the ``{...}`` hash tag), RQ job ids and output paths, so it
#: keeps to this alphabet: a name can never close the hash tag, hold the separator or climb out of OUT/.
DATASET_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
DATASET_NAME_RULE = 'letters, digits, "_" and "-" only, 1 to 64 characters'


def valid_dataset_name(name: str) -> bool:
    return DATASET_NAME_RE.fullmatch(name) is not None


@dataclass(frozen=True)
class DatasetKeys:
    """The keys of one dataset, whose name must be a valid dataset name (checked here: ValueError). Each key is
    built once per instance (the ledger keeps one instance per dataset: admit and commit run thousands of times a
    second)."""

    name: str

    def __post_init__(self) -> None:
        if not valid_dataset_name(self.name):
            raise ValueError(f"invalid dataset name {self.name!r}: {DATASET_NAME_RULE}")

    @functools.cached_property
    def base(self) -> str:
        return f"{PREFIX}ds:{{{self.name}}}"

    @functools.cached_property
    def meta(self) -> str:
        return self.base

    @functools.cached_property
    def used(self) -> str:
        return self.base + ":used"

    @functools.cached_property
    def done(self) -> str:
        return self.base + ":done"

    @functools.cached_property
    def pending(self) -> str:
        return self.base + ":pending"

    @functools.cached_property
    def chunks(self) -> str:
        return self.base + ":chunks"

    @functools.cached_property
    def seq(self) -> str:
        return self.base + ":seq"

    @functools.cached_property
    def results(self) -> str:
        return self.base + ":results"

    @functools.cached_property
    def failed(self) -> str:
        return self.base + ":failed"

    @functools.cached_property
    def collector(self) -> str:
        return self.base + ":collector"

    @functools.cached_property
    def resv(self) -> str:
        return self.base + ":resv"

    @functools.cached_property
    def inflight(self) -> str:
        return self.base + ":inflight"

    @functools.cached_property
    def lengths(self) -> str:
        return self.base + ":lengths"

    @functools.cached_property
    def turn_lengths(self) -> list[str]:
        """``lengths:0`` .. ``lengths:{TURN_BUCKETS - 1}``: the recent lengths of each turn of conversations."""
        return [f"{self.base}:lengths:{j}" for j in range(TURN_BUCKETS)]

    @functools.cached_property
    def stats(self) -> str:
        return self.base + ":stats"

    @functools.cached_property
    def progress(self) -> str:
        return self.base + ":progress"

    @functools.cached_property
    def discarded(self) -> str:
        return self.base + ":discarded"

    @functools.cached_property
    def turns(self) -> str:
        return self.base + ":turns"

    @functools.cached_property
    def turnrec(self) -> str:
        return self.base + ":turnrec"

    @functools.cached_property
    def convs(self) -> str:
        return self.base + ":convs"

    def all(self) -> list[str]:
        """Every key of the dataset (for ``--new-run``, which starts it over)."""
        return [self.meta, self.used, self.done, self.pending, self.chunks, self.seq, self.results,
                self.failed, self.collector, self.resv, self.inflight, self.lengths, self.stats, self.progress,
                self.discarded, self.turns, self.turnrec, self.convs, *self.turn_lengths]


def chunk_id(dataset: str, seq: int) -> str:
    """The RQ job id of a dataset's ``seq``-th chunk.

    RQ re-pushes (and so runs twice) a job id enqueued twice, so ids come from a Redis counter and are never
    reused. Ids allow only ``[A-Za-z0-9_-]``; the seq is the trailing ``-NNNNNNN``, so two (dataset, seq)
    pairs never give the same id.
    """
    return f"bq-{dataset}-{seq:07d}"


#: Turn indexes with a length list of their own (``lengths:{j}``); every later turn shares the last one's. The
#: commit_turn script picks ``KEYS[11 + min(turn, 3)]``: keep the two in step.
TURN_BUCKETS = 4


def turn_bucket(turn: int) -> int:
    """The ``lengths:{j}`` list (and predict's model) of a conversation's ``turn``: its own for 0..2, then 3."""
    return min(max(turn, 0), TURN_BUCKETS - 1)


#: The one separator of budgetq's composite names, byte 0x1f. Ids hold no control characters (producer/inputs/records.py
#: refuses them at read), so each encoding below parses back unambiguously; the Lua scripts write it as '\\31'.
#:
#: | encoding       | form                                   | built by                     | parsed at        |
#: | -------------- | -------------------------------------- | ---------------------------- | ---------------- |
#: | sample key     | ``{prompt id}SEP{generation}`` (k >= 1; | producer/generations.py      | its last SEP     |
#: |                | generation 0 is the prompt id alone)   | ``sample_key``               | (``split_key``)  |
#: | turn field     | ``{turn}SEP{sample key}``              | ``turn_field`` (below),      | its first SEP    |
#: |                | (``turns``, ``turnrec`` hash fields)   | COMMIT_TURN and its kin      | (digits first)   |
#: | turn request   | ``{turn}SEP{sample key}`` (turn >= 1;  | budget/record.py            | never: hashed    |
#: | key            | turn 0 is the sample key alone)        | ``turn_request_key``         | into the rid     |
#: | progress field | ``{chunk}SEP{turn bucket}``            | REFRESH_CHUNK                | its last SEP     |
#: |                | (the progress hash)                    |                              | (outcomes.py)    |
SEP = "\x1f"


def turn_field(sample: str, turn: int) -> str:
    """The field of a conversation's ``turn``-th turn (0-based) in ``turns`` and ``turnrec``; the commit_turn
    script builds the same string (budget/scripts.py COMMIT_TURN)."""
    if isinstance(turn, bool) or not isinstance(turn, int) or turn < 0:
        raise ValueError(f"a turn index is an int >= 0, not {turn!r}")
    return f"{turn}{SEP}{sample}"


def rq_job_key(job_id: str) -> str:
    return RQ_JOB_PREFIX + job_id
