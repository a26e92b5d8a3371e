import pytest

from tests.serverproc import ServerProcess


@pytest.fixture(scope="session")
def server():
    """The embedded-model server shared by the integration tests (reasoning parser on)."""
    srv = ServerProcess("--max-model-len", "2048", "--reasoning-parser", "qwen3").wait_ready()
    yield srv
    srv.stop()
