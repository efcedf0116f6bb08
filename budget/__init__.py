"""The shared layer: everything both ``produce`` (producer/) and the workers (worker/) need, and nothing of either.

Data flows one way (docs/architecture.md): producer/ and worker/ import budget/ and render/, never each other, and
budget/ imports neither. So what both sides must agree on lives here, and only here:

- Redis state. ``keys`` names every key; ``scripts`` holds the Lua, one atomic decision each; ``ledger`` is the
  typed call for each script, what it answers, and a call as a value, many of them in one round trip (how the
  worker batches); ``runstate`` is the producer's plain bookkeeping that is not a decision, a run's tokenizer
  files included; ``serverinfo`` what the SGLang servers say about themselves (the workers fetch and store it,
  ``produce`` reads it for the manifests) and what each worker reports of them; ``connection`` how any of them
  opens a Redis client.
- The contracts between the two sides. ``payload`` is the chunk job a worker receives; ``record`` the output
  record a worker commits and ``produce`` writes; ``history`` and ``conversation`` the rules of a multi-turn
  conversation, which the worker walks between turns and ``produce`` when it ends one a dead worker left.
- Plumbing both processes share: ``logs`` (one line per event, text or JSON).
"""
