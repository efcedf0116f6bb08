"""``produce run --chat-template FILE`` (docs/inputs.md, "A chat template of your own"): the file's template renders
every prompt, the workers' later turns and export's row check (which refuses a file changed since the run); its
content is a setting of the run; a file that cannot be used is exit 2 before Redis is touched."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner

from budget.record import plan
from producer.cli import main
from producer.errors import ProduceError
from producer.export.writer import ExportError, ExportJob, ExportOptions
from producer.prepare import Inputs, load_inputs
from producer.results import RESULTS, RUN
from producer.session.loop import Producer
from producer.settings import ALL, CHAT_TEMPLATE, CHAT_TEMPLATE_PATH
from render.chat import Renderer, load_tokenizer, read_chat_template
from tests.chats import DS, SIM_ARGS, options, write_dataset
from tests.producers import run_settings
from worker import turns
from worker.turns import renderer_for

MARKER = "[[tpl]]"
#: A Qwen-style template that writes MARKER into every message header: any prompt rendered with it shows it.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }} " + MARKER + "\n{{ m.content }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def template_file(tmp_path: Path, text: str = TEMPLATE, name: str = "chat.jinja") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def inputs_for(tmp_path: Path, tokenizer: Path, *extra: str) -> Inputs:
    args = [str(write_dataset(tmp_path)), "--tokenizer", str(tokenizer), "--max-tokens", "16", "--order", "file",
            "--reasoning-parser", "qwen3", "--turns", ALL, *extra]
    return load_inputs(run_settings(*args), echo=lambda m: None, warn=lambda m: None)


def attach(r: "redis.Redis", tmp_path: Path, inputs: Inputs) -> Producer:
    producer = Producer(r, inputs.prepared, options(tmp_path, inputs), echo=lambda m: None)
    producer.attach()
    return producer


def test_the_file_renders_every_prompt_and_is_a_setting_of_the_run(r: "redis.Redis", tmp_path: Path,
                                                                   tokenizer_dir: Path) -> None:
    tok = load_tokenizer(tokenizer_dir)
    plain = inputs_for(tmp_path, tokenizer_dir)
    path = template_file(tmp_path)
    given = inputs_for(tmp_path, tokenizer_dir, "--chat-template", str(path))
    [p], [q] = plain.prepared, given.prepared
    assert list(p.prompts) == list(q.prompts) == ["one", "two", "three"]
    for sid, prompt in q.prompts.items():
        text = tok.decode(list(prompt.input_ids), skip_special_tokens=False)
        assert isinstance(text, str)
        assert MARKER in text and MARKER not in tok.decode(list(p.prompts[sid].input_ids), skip_special_tokens=False)
        assert text.endswith("<|im_start|>assistant\n")  # the file's generation prompt, not the tokenizer's "<think>"
    assert given.settings.stored["tokenizer"] != plain.settings.stored["tokenizer"]
    assert given.settings.stored[CHAT_TEMPLATE] == read_chat_template(path).digest
    assert CHAT_TEMPLATE not in plain.settings.stored

    attach(r, tmp_path, given).release()
    run_file = tmp_path / "out" / DS / RUN
    stored = json.loads(run_file.read_text())
    assert stored[CHAT_TEMPLATE_PATH] == str(path.resolve())
    assert stored[CHAT_TEMPLATE] == read_chat_template(path).digest
    before = (run_file.read_bytes(), r.dbsize())
    tokens = ExportOptions(format="tokens")
    job = ExportJob.build([DS], tmp_path / "out", tokens, dest=None, tokenizer_dir=None)  # the run's, from run.json
    assert job.tokenizer is not None and job.tokenizer.chat_template == TEMPLATE
    # The same file path with other content is another run's settings: refused before anything is written.
    path.write_text(TEMPLATE.replace(MARKER, "[[other]]"), encoding="utf-8")
    changed = inputs_for(tmp_path, tokenizer_dir, "--chat-template", str(path))
    for rerun, said in ((changed, "--chat-template: stored sha256 "), (plain, ", now none")):
        with pytest.raises(ProduceError) as err:
            attach(r, tmp_path, rerun)
        assert err.value.exit_code == 2 and said in str(err.value), str(err.value)
        assert (run_file.read_bytes(), r.dbsize()) == before
    with pytest.raises(ExportError, match=f"chat template file {path} .*changed since the run"):
        ExportJob.build([DS], tmp_path / "out", tokens, dest=None, tokenizer_dir=str(tokenizer_dir))


def test_a_worker_renders_a_later_turn_with_the_files_template(r: "redis.Redis", tmp_path: Path,
                                                               tokenizer_dir: Path) -> None:
    """The tokenizer files attach stores for the workers carry the file as their template: the worker's renderer
    has the run's fingerprint and renders turn 2 of a conversation as the producer does, marker and all."""
    path = template_file(tmp_path)
    inputs = inputs_for(tmp_path, tokenizer_dir, "--chat-template", str(path))
    attach(r, tmp_path, inputs).release()
    turns.forget()
    fp = str(inputs.settings.stored["tokenizer"])
    worker = renderer_for(r, fp, root=tmp_path / "worker-cache")
    assert worker.fingerprint() == fp
    three = inputs.prepared[0].prompts["three"].sample.messages
    later = plan(three)[2].context  # turn 2's prompt: two answers and the third question
    rendered = worker.render(later).input_ids
    assert rendered == inputs.renderer.render(later).input_ids
    text = worker.tokenizer.decode(rendered, skip_special_tokens=False)
    assert text.count(MARKER) == len(later)
    assert MARKER not in Renderer(load_tokenizer(tokenizer_dir)).tokenizer.decode(
        Renderer(load_tokenizer(tokenizer_dir)).render(later).input_ids, skip_special_tokens=False)
    turns.forget()


def test_a_tokenizer_without_a_template_renders_with_the_file(r: "redis.Redis", tmp_path: Path,
                                                              tokenizer_dir: Path) -> None:
    """A base model's tokenizer has no template (exit 2 without the option); the file is then the only one, on
    the producer's side and the worker's."""
    tok = tmp_path / "no-template"
    shutil.copytree(tokenizer_dir, tok)
    config = json.loads((tok / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tok / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ProduceError, match="has no chat_template: .*--chat-template FILE"):
        inputs_for(tmp_path, tok)
    path = template_file(tmp_path)
    inputs = inputs_for(tmp_path, tok, "--chat-template", str(path))
    attach(r, tmp_path, inputs).release()
    turns.forget()
    worker = renderer_for(r, str(inputs.settings.stored["tokenizer"]), root=tmp_path / "worker-cache")
    later = plan(inputs.prepared[0].prompts["two"].sample.messages)[1].context
    assert worker.render(later) == inputs.renderer.render(later)
    assert MARKER in worker.tokenizer.decode(worker.render(later).input_ids, skip_special_tokens=False)
    turns.forget()


@pytest.mark.parametrize("content, reason", [
    (None, "no such file"),
    ("{% for m in messages %}{{ m.content }}", "not a valid Jinja template"),
    (b"\xff\xfe{{ x }}", "not UTF-8"),
    ("  \n", "the file is empty"),
])
def test_a_file_that_cannot_be_used_is_one_error_line_and_exit_2(tmp_path: Path, redis_url: str, r: "redis.Redis",
                                                                 tokenizer_dir: Path, content: Any,
                                                                 reason: str) -> None:
    r.set("someone-elses-key", "x")
    path = tmp_path / "bad.jinja"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content, encoding="utf-8")
    res = CliRunner().invoke(main, [str(write_dataset(tmp_path)), "--tokenizer", str(tokenizer_dir), "--max-tokens",
                                    "16", "--chat-template", str(path), "--out", str(tmp_path / "out"),
                                    "--redis-url", redis_url], catch_exceptions=False)
    assert res.exit_code == 2, res.output
    errors = [line for line in res.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and str(path) in errors[0] and reason in errors[0], res.output
    assert "Traceback" not in res.output
    assert r.dbsize() == 1 and not (tmp_path / "out").exists()


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_produce_and_export_use_the_file_on_real_workers(redis_url: str, tokenizer_dir: Path, tmp_path: Path,
                                                         sim_factory: Any, workers: Any) -> None:
    """``produce --chat-template`` with a real ``rq worker``: every request the server sees, later turns
    included, is rendered with the file; ``export --format tokens`` (the run's tokenizer from run.json) renders
    with it too, so every turn's prompt passes the check against what the worker sent."""
    import subprocess

    from tests import sim_log
    from tests.procs import produce_cmd, read_jsonl
    log = tmp_path / "requests.jsonl"
    sim = sim_factory(*SIM_ARGS, "--request-log", str(log), "--tokenizer", str(tokenizer_dir))
    worker_tmp = tmp_path / "worker-tmp"  # a tokenizer cache of its own: another test's copy would hide a fault
    worker_tmp.mkdir()
    workers(sim.url, TMPDIR=str(worker_tmp)).start("w0")
    out = tmp_path / "out"
    path = template_file(tmp_path)
    res = subprocess.run([*produce_cmd(), str(write_dataset(tmp_path)), "--tokenizer", str(tokenizer_dir),
                          "--max-tokens", "64", "--reasoning-parser", "qwen3", "--out", str(out),
                          "--redis-url", redis_url, "--quiet"],
                         env={**os.environ, "BUDGETQ_CHAT_TEMPLATE": str(path)},
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    recs = {x["id"]: x for x in read_jsonl(out / DS / RESULTS)}
    assert {sid: len(rec["turns"]) for sid, rec in recs.items()} == {"one": 1, "two": 2, "three": 3}
    exchanges = sim_log.exchanges(log, load_tokenizer(str(tokenizer_dir)))
    seen = sim_log.of_sample(exchanges, DS, "three")
    assert len(seen) == 3
    for i, answers in enumerate(seen):
        assert answers[-1].prompt.count(MARKER) == 1 + 2 * i, answers[-1].prompt  # its users and answers
    exported = subprocess.run([*produce_cmd(), "export", DS, "--out", str(out), "--format", "tokens",
                               "--dest", str(tmp_path / "tokens.jsonl")], capture_output=True, text=True, timeout=120)
    assert exported.returncode == 0, exported.stderr
    assert "re-rendered prompt differs" not in exported.stderr
    rows = read_jsonl(tmp_path / "tokens.jsonl")
    assert len(rows) == 6  # every turn of every conversation: 1 + 2 + 3
    assert list((worker_tmp / turns.CACHE_DIR_NAME).iterdir())  # the worker did load the shared files
