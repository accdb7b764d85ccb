"""What a tensor is to a compiled step (a runtime input, a weight, the KV cache, ...): below both
IRs, since the graph IR tags its inputs with it and the schedule IR its buffers."""
from __future__ import annotations

import enum


class BufferKind(enum.IntEnum):
    IO_INPUT = 0     # a runtime input (token ids, decode position)
    IO_OUTPUT = 1    # returned to the caller
    WEIGHT = 2       # model parameter, read only
    CONST = 3        # a table the compiler made (rope frequencies), read only
    KV_CACHE = 4     # persistent state, updated in place
    ACTIVATION = 5   # scratch between tasks, owned by the backend
