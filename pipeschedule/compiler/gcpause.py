"""`gc_paused`: run a function with Python's cyclic garbage collector paused.

A large schedule is about a million small `Instr` objects, none of them in a cycle. The
collector still walks them again and again while they are being created, which was half
the time of lowering and verifying pp=64, v=2, m=512. Pausing it around the compiler's
entry points costs nothing else: reference counting still frees everything.
"""

from __future__ import annotations

import functools
import gc


def gc_paused(function):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return function(*args, **kwargs)
        finally:
            if was_enabled:
                gc.enable()

    return wrapper
