"""`freeze_startup_heap`: what lives at start-up leaves the collector's walks; what comes later,
cycles included, is still collected."""

import gc
import weakref

from pegaserve.heap import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def test_the_startup_heap_is_frozen_and_later_cycles_are_still_collected():
    startup = _Node()
    startup_ref = weakref.ref(startup)
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() > 0
        del startup
        gc.collect()
        assert startup_ref() is not None  # alive at start-up: frozen, never walked again
        later = weakref.ref(_Node())
        gc.collect()
        assert later() is None
    finally:
        gc.unfreeze()
    gc.collect()
    assert startup_ref() is None
