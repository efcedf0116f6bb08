"""SGLang 0.5.23's own request and response types, loaded from the installed wheel without torch.

The sglang wheel is installed with ``--no-deps`` for the tests only (scripts/bootstrap.sh); it is never a
runtime dependency. ``import sglang`` would run sglang/__init__.py, which pulls in torch, psutil and the
whole runtime, so the two modules the contract needs are loaded straight from their files instead:

- ``sglang/api/v1/api_types.py``: the JSON contract of the HTTP server (``GenerateRequest``, its
  ``SamplingParams`` that rejects unknown keys, ``GenerateResponse``), needing only msgspec;
- ``sglang/srt/sampling/sampling_params.py``: the SamplingParams the scheduler builds from
  ``sampling_params`` with ``SamplingParams(**d)`` and checks with ``verify(vocab_size)``. It imports
  ``watermarking/core.py``, which imports torch at the top but uses it only inside the watermark kernels
  (its annotations are lazy); that one import is given an empty module while SGLang's files load, and
  nothing of it runs.

The parent packages are bare namespace modules pointing at the wheel's folders, so no ``__init__`` runs;
``sys.modules`` is restored afterwards, so nothing else in the test process sees them.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import sys
import types
from pathlib import Path
from typing import Any

SGLANG_VERSION = "0.5.23"
_PACKAGES = ("sglang", "sglang.api", "sglang.api.v1", "sglang.srt", "sglang.srt.sampling",
             "sglang.srt.sampling.watermarking")


def wheel_root() -> Path:
    """The folder holding the installed ``sglang`` package; AssertionError when it is not installed."""
    try:
        dist = importlib.metadata.distribution("sglang")
    except importlib.metadata.PackageNotFoundError:
        raise AssertionError("the sglang wheel is not installed: scripts/bootstrap.sh installs "
                             f"sglang=={SGLANG_VERSION} with --no-deps for the tests") from None
    assert dist.version == SGLANG_VERSION, f"sglang {dist.version} installed, the contract is {SGLANG_VERSION}"
    return Path(str(dist.locate_file("sglang")))


def load() -> tuple[types.ModuleType, types.ModuleType]:
    """(api_types, srt sampling_params), SGLang's own modules."""
    root = wheel_root()
    saved = {name: mod for name, mod in sys.modules.items()
             if name == "torch" or name == "sglang" or name.startswith(("sglang.", "torch."))}
    try:
        for name in _PACKAGES:
            pkg = types.ModuleType(name)
            pkg.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
            sys.modules[name] = pkg
        sys.modules["torch"] = types.ModuleType("torch")  # imported, never used, by watermarking/core.py
        api = importlib.import_module("sglang.api.v1.api_types")
        sampling = importlib.import_module("sglang.srt.sampling.sampling_params")
    finally:
        for name in [n for n in sys.modules if n == "torch" or n == "sglang" or n.startswith(("sglang.", "torch."))]:
            del sys.modules[name]
        sys.modules.update(saved)
    return api, sampling


class Contract:
    """Checks one /generate body or answer the way SGLang 0.5.23 does."""

    def __init__(self, vocab_size: int = 151_936) -> None:  # Qwen3's, above every id budgetq's tests use
        self.api, self.sampling = load()
        self.vocab_size = vocab_size
        self.request_fields = set(self.api.GenerateRequest.__struct_encode_fields__)

    def request(self, body: Any) -> Any:
        """Decode ``body`` with SGLang's GenerateRequest (raises api_types.JsonContractError, an HTTP 400 there),
        then build and verify the scheduler's SamplingParams (raises ValueError, a 400 there)."""
        assert isinstance(body, dict), body
        unknown = set(body) - self.request_fields  # GenerateRequest ignores these; nothing budgetq sends is one
        assert not unknown, f"keys SGLang does not know: {sorted(unknown)}"
        req = self.api.GenerateRequest.from_json_value(body)
        sp = body.get("sampling_params") or {}
        assert isinstance(sp, dict), "one prompt, one sampling_params object"
        params = self.sampling.SamplingParams(**sp)
        params.verify(self.vocab_size)
        return req

    def response(self, body: Any) -> Any:
        """Decode a 200 body with SGLang's GenerateResponse (raises api_types.JsonContractError)."""
        return self.api.GenerateResponse.from_json_value(body)
