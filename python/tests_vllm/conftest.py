"""The vLLM connector's tests run in .cache/vllm-venv (make test-vllm),
with the main tests' helpers for real ``kvsp serve`` processes."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
