"""``checkpoint.py PATH save|restore``: save a tree of global tensors on a 2x4
placement, or restore it into other layouts and print ``RESTORED exact`` when
every value equals the one saved. Run with one process (8 devices) or two
(``python -m sbpjax.launch -n 2 --local-devices 4``), in either order."""

import sys

import numpy as np

import sbpjax as sj
from sbpjax import B, S
from sbpjax import checkpoint as ck

pl = sj.placement((2, 4), ("x", "y"))
x = np.arange(64, dtype=np.float32).reshape(8, 8) / 7
uneven = x[:6, :5]  # splits 6 over 4 and 5 over 2: uneven pieces
path, mode = sys.argv[1], sys.argv[2]
if mode == "save":
    tree = {
        "a": sj.to_global(x, pl, (S(0), S(1))),
        "b": sj.to_global(uneven, pl, (S(1), S(0))),
        "c": sj.to_global(x, pl, (sj.P, B)),  # saved reduced
        "step": 3,
    }
    ck.save(path, tree)
else:
    target = {
        "a": ck.layout(pl, (B, S(0))),
        "b": ck.layout(pl, (S(0), S(1))),
        "c": ck.layout(pl, (S(1), B)),
        "step": 0,
    }
    tree = ck.restore(path, target)
    exact = (
        np.array_equal(tree["a"].numpy(), x)
        and np.array_equal(tree["b"].numpy(), uneven)
        and np.array_equal(tree["c"].numpy(), x)
        and tree["step"] == 3
        and tree["a"].sbp == (B, S(0))
    )
    print("RESTORED", "exact" if exact else "DIFFERENT")
