"""The public names of python-api.md are importable from the top-level package."""

from __future__ import annotations

import subprocess
import sys

import chatroute

SPEC_NAMES = [
    # chat abstractions
    "ChatRole",
    "ChatMessage",
    "ChatOptions",
    "ChatResponse",
    "ChatResponseUpdate",
    "ChatClient",
    "DelegatingChatClient",
    "ConfigureOptionsChatClient",
    "EmbeddingGenerator",
    "TextContent",
    "TextReasoningContent",
    "FunctionCallContent",
    "FunctionResultContent",
    # routing
    "RoutingContext",
    "RoutingChatClient",
    "ScoreAggregation",
    "SemanticRoutingChatClient",
    "RouteDecision",
    # failover
    "FailoverChatClient",
    "FailoverChatClientAttempt",
    "OrderedFailoverChatClient",
    # engine parts
    "SentenceTransformerEmbedder",
    "ProfileIndex",
]


def test_spec_names_are_exported() -> None:
    missing = [n for n in SPEC_NAMES if not hasattr(chatroute, n)]
    assert missing == []
    assert set(SPEC_NAMES) <= set(chatroute.__all__)


def test_all_names_resolve() -> None:
    for name in chatroute.__all__:
        assert getattr(chatroute, name) is not None, name


def test_engine_imports_without_the_server_stack() -> None:
    # The engine must run where only torch, numpy, faiss and sentence-transformers exist.
    code = (
        "import sys\n"
        "blocked = ('fastapi', 'pydantic', 'uvicorn', 'openai', 'typer',\n"
        "           'prometheus_client', 'yaml')\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in blocked:\n"
        "            raise ImportError('blocked ' + name)\n"
        "        return None\n"
        "sys.meta_path.insert(0, Block())\n"
        "import chatroute\n"
        "from chatroute import (SemanticRoutingChatClient, SentenceTransformerEmbedder,\n"
        "                       ProfileIndex, HealthAwareFailoverChatClient)\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_every_module_opens_with_a_one_line_purpose() -> None:
    import ast
    from pathlib import Path

    root = Path(chatroute.__file__).parent
    for path in sorted(root.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        assert doc, f"{path.relative_to(root)} has no module docstring"
        assert doc.splitlines()[0].strip(), f"{path.relative_to(root)}: empty first line"


def test_the_failover_package_exports_its_routers_and_the_classifier_has_its_name() -> None:
    from chatroute.failover import HealthAwareFailoverChatClient, TimeoutChatClient

    assert HealthAwareFailoverChatClient is chatroute.HealthAwareFailoverChatClient
    assert TimeoutChatClient is chatroute.TimeoutChatClient
    assert "classify_failure" in chatroute.__all__ and "classify" not in chatroute.__all__
    assert not hasattr(chatroute, "classify")  # not to be confused with /v1/classify
    error = chatroute.ProviderTimeoutError("late")
    assert chatroute.classify_failure(error) is chatroute.FailureKind.TIMEOUT
