"""`srv`: the HTTP server over a scripted engine core (tests/fakes.py), one per module that asks
for it; a module that defines its own `srv` keeps that."""
from __future__ import annotations

from typing import Iterator

import pytest
from fakes import Server, live_server


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    with live_server() as s:
        yield s
