"""Hypothesis strategies for dataset records: any JSON (``json_values``), records of every shape with any values in
their fields (``records``), and mostly valid ones (``plausible``) so that a fuzz also walks the success path, old-answer
dropping and duplicate ids."""
from __future__ import annotations

from typing import Any

from hypothesis import strategies as st


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12,
)
roles = st.sampled_from(["system", "user", "assistant", "tool", "bot", "human", "gpt", "observation"])
contents = (st.text(max_size=10) | st.none()
            | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": json_scalars}),
                       max_size=3)
            | json_values)
messages = st.lists(
    st.fixed_dictionaries({"role": roles, "content": contents},
                          optional={"tool_calls": st.none() | st.lists(json_values, max_size=2) | json_scalars}),
    max_size=5,
)
sharegpt = st.lists(st.fixed_dictionaries({"from": roles, "value": st.text(max_size=10) | json_scalars}), max_size=5)
ids = st.none() | st.integers() | st.text(max_size=6) | st.sampled_from(["1", "a", "\x00"]) | json_values
records = st.fixed_dictionaries({}, optional={
    "id": ids, "messages": messages | json_values, "prompt": st.text(max_size=10) | json_values,
    "conversations": sharegpt | json_values,
})
# Mostly-valid records too, so the fuzz also walks the success path, old-answer dropping and duplicate ids.
small_ids = st.none() | st.integers(0, 3) | st.sampled_from(["0", "a", "b"])
turns = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool"]),
                               "content": st.text(max_size=8)}, optional={"name": st.text(max_size=3)})
plausible_messages = st.tuples(st.lists(turns, max_size=4), st.text(max_size=8), st.integers(0, 2)).map(
    lambda t: t[0] + [user(t[1])] + [{"role": "assistant", "content": "old"}] * t[2])
SHAREGPT_FROM = {"system": "system", "user": "human", "assistant": "gpt", "tool": "observation"}
plausible = st.one_of(
    st.fixed_dictionaries({"messages": plausible_messages}, optional={"id": small_ids}),
    st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=8)}, optional={"id": small_ids}),
    st.fixed_dictionaries({"conversations": plausible_messages.map(
        lambda ms: [{"from": SHAREGPT_FROM[m["role"]], "value": m["content"]} for m in ms])},
        optional={"id": small_ids}),
)
