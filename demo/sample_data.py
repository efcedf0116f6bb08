"""Three small datasets for the demo, in the three shapes the producer reads.

- ``glaive_fc.jsonl``: function calling, as ``messages`` with a system prompt describing a tool; some records carry
  an assistant ``tool_calls`` turn and the tool's result, so the next turn answers from it.
- ``code_instruct.jsonl``: one ``prompt`` string per record.
- ``agent_traces.jsonl``: ShareGPT ``conversations`` (``from``: system/human/gpt), each ending with an old ``gpt``
  answer that the producer drops before regenerating it.

Every record has an ``id``; a few are ints among the strings, as real datasets mix them. The records are made from
fixed tables with a seeded generator, so the files are the same on every run; the committed copies in demo/data/
are this module's output (`python -m demo.sample_data demo/data` rewrites them, and a test checks they match).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Callable, Final

import click

Record = dict[str, Any]

DATA_DIR: Final = Path(__file__).parent / "data"

_TOOLS: Final[list[dict[str, Any]]] = [
    {
        "name": "get_weather",
        "description": "Get the current weather for a city",
        "parameters": {"city": "string", "unit": "string (celsius or fahrenheit)"},
    },
    {
        "name": "convert_currency",
        "description": "Convert an amount from one currency to another",
        "parameters": {"amount": "number", "from_currency": "string", "to_currency": "string"},
    },
    {
        "name": "search_restaurants",
        "description": "Find restaurants in a city by cuisine",
        "parameters": {"city": "string", "cuisine": "string"},
    },
    {
        "name": "calculate_bmi",
        "description": "Calculate the body mass index from weight and height",
        "parameters": {"weight_kg": "number", "height_m": "number"},
    },
    {
        "name": "get_stock_price",
        "description": "Get the latest price of a stock by its ticker symbol",
        "parameters": {"symbol": "string"},
    },
    {
        "name": "translate_text",
        "description": "Translate a text into another language",
        "parameters": {"text": "string", "target_language": "string"},
    },
]
_CITIES: Final = ("Paris", "London", "Tokyo", "New York", "Berlin", "Madrid", "Sydney", "Toronto")
_CURRENCIES: Final = ("USD", "EUR", "GBP", "JPY", "CAD")
_CUISINES: Final = ("Italian", "Japanese", "Mexican", "Indian", "French")
_SYMBOLS: Final = ("AAPL", "MSFT", "GOOG", "AMZN", "NVDA")
_LANGUAGES: Final = ("French", "German", "Spanish", "Japanese")
_PHRASES: Final = ("Good morning, how are you?", "Where is the train station?", "Thank you for your help.")


def _call(rng: random.Random, tool: dict[str, Any]) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """A user question for `tool`, the arguments a model would call it with, and the tool's result."""
    name = tool["name"]
    if name == "get_weather":
        city, unit = rng.choice(_CITIES), rng.choice(("celsius", "fahrenheit"))
        result: dict[str, Any] = {"temperature": rng.randint(-5, 35), "unit": unit}
        return f"What's the weather like in {city} right now?", {"city": city, "unit": unit}, result
    if name == "convert_currency":
        amount, (src, dst), rate = rng.randint(10, 5000), rng.sample(_CURRENCIES, 2), round(rng.uniform(0.5, 1.8), 4)
        arguments = {"amount": amount, "from_currency": src, "to_currency": dst}
        return f"How much is {amount} {src} in {dst}?", arguments, {"converted_amount": round(amount * rate, 2)}
    if name == "search_restaurants":
        city, cuisine = rng.choice(_CITIES), rng.choice(_CUISINES)
        result = {"restaurants": [f"{cuisine} Corner {n}" for n in rng.sample(range(1, 40), 3)]}
        return f"Can you find me a good {cuisine} restaurant in {city}?", {"city": city, "cuisine": cuisine}, result
    if name == "calculate_bmi":
        weight, height = rng.randint(50, 110), round(rng.uniform(1.5, 2.0), 2)
        question = f"I weigh {weight} kg and I am {height} m tall. What is my BMI?"
        return question, {"weight_kg": weight, "height_m": height}, {"bmi": round(weight / height**2, 1)}
    if name == "get_stock_price":
        symbol = rng.choice(_SYMBOLS)
        result = {"symbol": symbol, "price": round(rng.uniform(50, 900), 2)}
        return f"What is the current stock price of {symbol}?", {"symbol": symbol}, result
    phrase, language = rng.choice(_PHRASES), rng.choice(_LANGUAGES)
    result = {"translation": f"[{language}] {phrase}"}
    return f"Translate '{phrase}' into {language}.", {"text": phrase, "target_language": language}, result


def glaive_fc_records() -> list[Record]:
    """~120 function-calling conversations; one in three has a tool call and its result, one in six follows up."""
    rng = random.Random(1)
    records: list[Record] = []
    for i in range(120):
        tool = _TOOLS[i % len(_TOOLS)]
        question, arguments, result = _call(rng, tool)
        system = (
            "You are a helpful assistant with access to the following functions. Use them if required -\n"
            + json.dumps(tool, indent=2)
        )
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        if i % 3 == 1:
            call_id = f"call_{i:04d}"
            # Both encodings of arguments occur in the wild: a JSON string (OpenAI) or an object (HF templates).
            args: Any = json.dumps(arguments) if i % 2 else arguments
            call = {"id": call_id, "type": "function", "function": {"name": tool["name"], "arguments": args}}
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            tool_result = {"role": "tool", "tool_call_id": call_id, "name": tool["name"], "content": json.dumps(result)}
            messages.append(tool_result)
            if i % 6 == 4:
                messages.append({"role": "assistant", "content": f"Here is what I found: {json.dumps(result)}."})
                messages.append({"role": "user", "content": "Thanks! Can you explain that in one sentence?"})
        record_id: str | int = 10_000 + i if i % 10 == 7 else f"glaive-{i:05d}"
        records.append({"id": record_id, "messages": messages})
    return records


_CODE_TASKS: Final = (
    "Write a {lang} function that {task}.",
    "Implement {task_ing} in {lang}. Explain the time complexity of your solution.",
    "In {lang}, write code that {task}. Include unit tests for the edge cases.",
    "Review this approach and write a cleaner {lang} version: a loop that {task}, using global variables.",
    "I am learning {lang}. Show me, step by step, how to write code that {task}.",
)
_TASKS: Final = (
    ("returns the n-th Fibonacci number", "an n-th Fibonacci number function"),
    ("checks whether a string is a palindrome", "a palindrome check"),
    ("merges two sorted lists into one sorted list", "merging two sorted lists"),
    ("counts the words in a text file and prints the ten most common", "a word frequency counter"),
    ("parses a CSV file and sums the third column", "a CSV column sum"),
    ("finds the shortest path in a grid with obstacles", "a shortest path search on a grid"),
    ("validates an email address without a regular expression", "an email validator"),
    ("removes duplicates from a list while keeping the order", "order-preserving deduplication"),
    ("implements a least-recently-used cache with a fixed capacity", "an LRU cache"),
    ("flattens a nested list of arbitrary depth", "flattening a nested list"),
)
_CODE_LANGS: Final = ("Python", "JavaScript", "Rust", "Go", "C++", "Java")
_BUGGY_SNIPPET: Final = (
    "\n\n```python\ndef average(values):\n    total = 0\n    for v in values:\n        total += v\n"
    "    return total / len(values)\n```\n\nIt crashes on an empty list. Fix it and explain the fix."
)


def code_instruct_records() -> list[Record]:
    """~150 single-prompt coding instructions; every seventh asks to fix a snippet (a longer prompt)."""
    rng = random.Random(2)
    records: list[Record] = []
    for i in range(150):
        task, task_ing = _TASKS[i % len(_TASKS)]
        lang = rng.choice(_CODE_LANGS)
        prompt = _CODE_TASKS[rng.randrange(len(_CODE_TASKS))].format(lang=lang, task=task, task_ing=task_ing)
        if i % 7 == 3:
            prompt = f"Before I write code that {task}, I need this helper to work:" + _BUGGY_SNIPPET
        record_id: str | int = i if i % 5 == 0 else f"code-{i:04d}"
        records.append({"id": record_id, "prompt": prompt})
    return records


_AGENT_GOALS: Final = (
    ("find the population of {city} and compare it with {city2}", "search"),
    ("plan a three-day trip to {city} on a budget", "search"),
    ("list the files in the project and find where the config is loaded", "shell"),
    ("fix the failing test in tests/test_parser.py", "shell"),
    ("summarize the latest release notes of the requests library", "browse"),
)


def agent_traces_records() -> list[Record]:
    """~80 ShareGPT agent traces of one to three rounds, each ending with an old gpt answer."""
    rng = random.Random(3)
    records: list[Record] = []
    for i in range(80):
        template, tool = _AGENT_GOALS[i % len(_AGENT_GOALS)]
        city, city2 = rng.sample(_CITIES, 2)
        goal = template.format(city=city, city2=city2)
        turns: list[dict[str, str]] = []
        if i % 4 == 0:
            turns.append({"from": "system", "value": f"You are an agent. Tools: {tool}[query]. Think, act, observe."})
        turns.append({"from": "human", "value": f"Please {goal}."})
        for step in range(1 + i % 3):
            action = f"Action: {tool}[{goal.split(' and ')[0]} step {step + 1}]"
            turns.append({"from": "gpt", "value": f"Thought: I should gather facts first.\n{action}"})
            observation = f"Observation: result {rng.randint(100, 999)} for step {step + 1}."
            turns.append({"from": "human", "value": observation})
        turns.append({"from": "gpt", "value": f"Final answer: I have done what you asked ({goal})."})
        record_id: str | int = 500 + i if i % 8 == 5 else f"trace-{i:03d}"
        records.append({"id": record_id, "conversations": turns})
    return records


DATASETS: Final[dict[str, Callable[[], list[Record]]]] = {
    "glaive_fc.jsonl": glaive_fc_records,
    "code_instruct.jsonl": code_instruct_records,
    "agent_traces.jsonl": agent_traces_records,
}


def write_sample_data(directory: Path) -> list[Path]:
    """Write the three datasets into `directory` (created if needed) and return their paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, make in DATASETS.items():
        path = directory / name
        lines = (json.dumps(record, ensure_ascii=False) + "\n" for record in make())
        path.write_text("".join(lines), encoding="utf-8")
        paths.append(path)
    return paths


@click.command()
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path), default=DATA_DIR)
def main(directory: Path) -> None:
    """Write the demo datasets into DIRECTORY (default: the package's demo/data).

    Example: python -m demo.sample_data /tmp/demo-data
    """
    for path in write_sample_data(directory):
        click.echo(str(path))


if __name__ == "__main__":
    main()
