"""One 3-host testbed at 1 Gb/s for the tests of this folder that only use it (lifecycle tests build their own)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from weightsync.testbed import Testbed

from tests.tools.testbed.support import start_or_skip

LINK_GBPS = 1.0


@pytest.fixture(scope="module")
def testbed() -> Iterator[Testbed]:
    bed = start_or_skip(Testbed(3, link_gbps=LINK_GBPS))
    with bed:
        yield bed
