import signal

import pytest


@pytest.fixture(autouse=True)
def signal_handlers_restored():
    """A script's `Stop`, made in this process by a test (its `cli()`, say), takes over Ctrl-C and SIGTERM: each test
    gets this process's own handlers back, so that a Ctrl-C of the test session still stops it."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)
