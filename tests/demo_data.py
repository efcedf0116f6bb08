"""The sample datasets shipped in demo/data/, which the end-to-end tests run on (sizes as the files hold them)."""
from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "demo" / "data"
GLAIVE = DATA / "glaive_fc.jsonl"  # 120 samples
CODE = DATA / "code_instruct.jsonl"  # 150 samples
TRACES = DATA / "agent_traces.jsonl"  # 80 samples
