"""The worker's environment (worker/config.py): defaults, and a bad value named instead of silently ignored; and
the one parser of SGLang URL lists (budget/urls.py) that SGLANG_URL and ``produce export --server-url`` share."""
from __future__ import annotations

import pytest

from budget.urls import server_urls
from worker.config import WorkerConfig
from worker.sglang import deadline


def test_unset_or_empty_variables_keep_the_defaults() -> None:
    assert WorkerConfig.from_env({}) == WorkerConfig.from_env({"BUDGETQ_CONCURRENCY": " ", "BUDGETQ_RETRY_FOR": ""})
    assert WorkerConfig.from_env({}).request_timeout is None


def test_values_are_read() -> None:
    cfg = WorkerConfig.from_env({"BUDGETQ_CONCURRENCY": "8", "BUDGETQ_RETRY_FOR": "0", "BUDGETQ_REQUEST_TIMEOUT": "30",
                                 "BUDGETQ_PREDICT_MARGIN": "0", "BUDGETQ_BACKOFF_CAP": "2.5",
                                 "SGLANG_URL": "http://a:1/, http://b:2"})
    assert (cfg.concurrency, cfg.retry_for, cfg.request_timeout, cfg.predict_margin, cfg.backoff_cap) == \
        (8, 0.0, 30.0, 0.0, 2.5)
    assert cfg.servers == ("http://a:1", "http://b:2")
    assert WorkerConfig.from_env({}).predict_model_error == 1.0
    assert WorkerConfig.from_env({"BUDGETQ_PREDICT_MODEL_ERROR": "0"}).predict_model_error == 0.0


def test_a_request_deadline_is_the_set_timeout_or_grows_with_the_answer() -> None:
    assert deadline(WorkerConfig(request_timeout=30.0), 16384) == 30.0
    slow = WorkerConfig(min_tokens_per_second=5.0)
    assert deadline(slow, 0) == 120.0
    assert deadline(slow, 16384) == 120.0 + 16384 / 5.0 > 300.0  # beyond aiohttp's default 300 s total


@pytest.mark.parametrize("name, raw, message", [
    ("BUDGETQ_CONCURRENCY", "1.5", "expected a whole number"),
    ("BUDGETQ_MAX_ATTEMPTS", "0", "must be positive"),
    ("BUDGETQ_REQUEST_TIMEOUT", "nan", "must be positive"),
    ("BUDGETQ_CONNECT_TIMEOUT", "-1", "must be positive"),
    ("BUDGETQ_BACKOFF_CAP", "soon", "expected a number of seconds"),
    ("BUDGETQ_RETRY_FOR", "-1", "must be 0 or more"),
    ("BUDGETQ_PREDICT_MARGIN", "lots", "expected a number"),
    ("BUDGETQ_PREDICT_MODEL_ERROR", "-1", "must be 0 or more"),
    ("SGLANG_URL", "sglang:30000", "not an http(s) URL"),
])
def test_a_bad_value_names_the_variable(name: str, raw: str, message: str) -> None:
    with pytest.raises(ValueError) as exc:
        WorkerConfig.from_env({name: raw})
    assert str(exc.value).startswith(name) and message in str(exc.value)


def test_a_url_list_is_stripped_of_spaces_trailing_slashes_and_empty_items() -> None:
    assert server_urls(" http://a:1/ ,, https://b/v1/ ") == ("http://a:1", "https://b/v1")


@pytest.mark.parametrize("raw, message", [
    ("", "SGLANG_URL is empty"),
    (" , ", "SGLANG_URL is empty"),
    ("http://a:1,sglang:30000", "SGLANG_URL: 'sglang:30000' is not an http(s) URL"),
    ("ftp://a", "SGLANG_URL: 'ftp://a' is not an http(s) URL"),
])
def test_a_url_list_without_an_http_url_is_refused_naming_its_source(raw: str, message: str) -> None:
    with pytest.raises(ValueError) as exc:
        server_urls(raw)
    assert str(exc.value) == message
    with pytest.raises(ValueError, match="^--server-url"):
        server_urls(raw, "--server-url")
