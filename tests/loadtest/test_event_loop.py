import asyncio

import pytest

from loadtest import event_loop


def test_the_load_tester_runs_on_uvloop_where_installed():
    uvloop = pytest.importorskip("uvloop")

    async def loop_type() -> type:
        return type(asyncio.get_running_loop())

    assert event_loop.run(loop_type()) is uvloop.Loop


def test_a_failure_inside_reaches_the_caller():
    async def fails() -> None:
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        event_loop.run(fails())
