import openai
import pytest

from engine.frontend.tokenizer import Tokenizer
from engine.loader.embedded import ensure_embedded_checkpoint
from tests.serverproc import ServerProcess


@pytest.fixture(scope="session")
def server():
    """The embedded-model server shared by the integration tests (reasoning parser on)."""
    srv = ServerProcess("--max-model-len", "2048", "--reasoning-parser", "qwen3").wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    """An OpenAI client of the shared server (no retries, so a failure shows as it happened)."""
    return openai.OpenAI(
        base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120
    )


@pytest.fixture(scope="module")
def tokenizer():
    """The embedded model's tokenizer (the real Qwen3 one)."""
    return Tokenizer(ensure_embedded_checkpoint())
