"""What a verification worker process starts with: the caller's environment less anything that looks like
a secret, and whether the sandbox is wanted. The pool and the reference preflight (task.py) both start
such processes; this module sits below both so neither imports the other.
"""

from __future__ import annotations

import os
import re

from ..settings import settings

__all__ = ["SECRET_PATTERN", "is_secret", "worker_environment", "sandbox_wanted"]

# Environment variables a candidate must never see: API keys, tokens, passwords, cloud credentials.
SECRET_PATTERN = re.compile(
    r"(API_?KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|PRIVATE_?KEY|ACCESS_?KEY|SESSION_?KEY|AUTH)"
    r"|^(AWS_|AZURE_|GOOGLE_APPLICATION_CREDENTIALS|GCP_|GH_|GITHUB_|HF_|HUGGING_?FACE|OPENAI|ANTHROPIC|"
    r"GEMINI|MISTRAL|COHERE|GROQ|DEEPSEEK|TOGETHER|FIREWORKS|OPENROUTER|XAI_|WANDB_API|NPM_|PYPI_|TWINE_|"
    r"SSH_AUTH_SOCK|KUBECONFIG|DOCKER_AUTH|NETRC)", re.I)


def is_secret(name: str) -> bool:
    return bool(SECRET_PATTERN.search(name))


def worker_environment() -> dict[str, str]:
    """The environment a worker starts with: the caller's, less every variable that looks like a secret
    (so that not even the worker's /proc/self/environ holds one)."""
    return {k: v for k, v in os.environ.items() if not is_secret(k)}


def sandbox_wanted(asked: bool | None) -> bool:
    """``asked``, or (None) the STITCHCUDA_SANDBOX setting (on unless 0/off/false/no)."""
    if asked is not None:
        return bool(asked)
    return bool(settings().sandbox)
