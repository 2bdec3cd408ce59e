"""Where a split goes when a tensor is reshaped: pure planning on shapes.

A reshape regroups runs of dimensions whose products are equal (``_groups``). A split
survives it slice by slice when it is the outermost dimension of its group: it then lands on
the outermost output dimension holding whole slices (:func:`moved`). A split merged with
dimensions *outside* it (``reshape(batch * num_heads, ...)`` of a tensor split on its heads)
becomes a strided split (:func:`merged`). Nothing here touches a tensor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from typing import TypeVar

from sharding import layout

_S = TypeVar("_S", bound=layout.Split)

__all__ = ["groups", "moved", "merged", "local_reading"]


def groups(a: Sequence[int], b: Sequence[int]) -> list[tuple[list[int], list[int]]] | None:
    """Pair runs of dimensions of ``a`` and ``b`` with equal products (how a reshape regroups)."""
    found: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(a) or j < len(b):
        gi: list[int] = []
        gj: list[int] = []
        pa = pb = 1
        if i < len(a):
            gi.append(i)
            pa = a[i]
            i += 1
        if j < len(b):
            gj.append(j)
            pb = b[j]
            j += 1
        while pa != pb:
            if pa < pb and i < len(a):
                gi.append(i)
                pa *= a[i]
                i += 1
            elif pb < pa and j < len(b):
                gj.append(j)
                pb *= b[j]
                j += 1
            else:
                return None
        found.append((gi, gj))
    return found


def moved(a: Sequence[int], b: Sequence[int], split: _S) -> _S | None:
    """Where ``split`` of a tensor of shape ``a`` lands once reshaped to ``b``; ``None`` if not slice-exact.

    The split must be the outermost dimension of its group (the dimensions a reshape merges
    or cuts together); it then lands on the outermost output dimension that holds whole
    slices, its intervals scaled by the sizes merged inside it.
    """
    found = groups(a, b) if 0 not in a else None
    if found is None:
        return None
    for gi, gj in found:
        if split.dim not in gi:
            continue
        if any(a[d] != 1 for d in gi if d < split.dim):
            return None  # the split is not the outermost dimension of its group
        inner_in = math.prod(a[d] for d in gi if d > split.dim)
        for o in gj:  # the outermost output dimension that holds whole slices (constants sit inside)
            scaled = split.scaled(o, inner_in, math.prod(b[d] for d in gj if d > o))
            if scaled is not None:
                return scaled
            if b[o] != 1:
                return None
        return None
    return None


def merged(whole: Sequence[int], out: Sequence[int], dim: int) -> tuple[int, int, int] | None:
    """Where a reshape of shape ``whole`` to ``out`` merges the split ``dim`` with dimensions outside it.

    Returns ``(output dimension, blocks, inner)``: the output dimension holds ``blocks``
    blocks (the product of the merged outer dimensions), each split as the input's intervals
    times ``inner`` (the product of the merged inner dimensions). ``None`` when the split is the
    outermost dimension of its group, or the group is cut into several output dimensions.
    """
    found = groups(whole, out) if 0 not in whole else None
    if found is None:
        return None
    gi, gj = next((gi, gj) for gi, gj in found if dim in gi)
    if len(gj) != 1 or gi[0] == dim:
        return None
    return gj[0], math.prod(whole[d] for d in gi if d < dim), math.prod(whole[d] for d in gi if d > dim)


def _readings(local: Sequence[int], out: Sequence[int], dim: int, intervals: Sequence[tuple[int, int]]
              ) -> list[tuple[int, Fraction]]:
    """Every ``(output dimension, ratio)`` where a reshape of the local ``local`` (split on ``dim``) to ``out`` may
    land the split slice by slice: the dimensions before it regroup into those before the output dimension,
    the ones after it into the ones after, and every rank's interval times the ratio is whole."""
    if any(n == 0 for d, n in enumerate(local) if d != dim):
        return []
    length = local[dim]
    after = math.prod(local[dim + 1:])
    found = []
    for o in range(len(out)):
        inner = math.prod(out[o + 1:])
        if not inner or groups(local[:dim], out[:o]) is None:
            continue
        ratio = Fraction(after, inner)
        if out[o] != length * ratio or any((s * ratio).denominator != 1 or (n * ratio).denominator != 1
                                           for s, n in intervals):
            continue
        rest_in, rest_out = local[dim + 1:], out[o + 1:]
        if any(groups(rest_in[k:], rest_out[m:]) is not None and math.prod(rest_in[k:]) == math.prod(rest_out[m:])
               for k in range(len(rest_in) + 1) for m in range(len(rest_out) + 1)):
            found.append((o, ratio))
    return found


def local_reading(local: Sequence[int], out: Sequence[int], split: _S) -> _S | None:
    """Where ``split`` lands when this rank's slice, of shape ``local``, is reshaped to ``out`` with sizes computed
    from its own length; ``None`` unless every rank lands it at the same one place.

    A rank sees only its own sizes, and where its length is 0 or 1 next to dimensions of size 1
    several places may fit (``[1, 2] -> [1, 1, 2]`` on a length of 2: dimension 1 or 2). The one
    place is taken only when it is the only one this rank reads and the only one each other rank
    reads from its own sizes (this rank's, its length put in): then every rank decides alike.
    """
    found = _readings(local, out, split.dim, split.intervals)
    if len(found) != 1:
        return None
    o, ratio = found[0]
    for _, n in split.intervals:
        theirs_in = list(local)
        theirs_in[split.dim] = n
        theirs_out = list(out)
        theirs_out[o] = int(n * ratio)
        if _readings(theirs_in, theirs_out, split.dim, split.intervals) != found:
            return None
    return split.scaled(o, ratio.numerator, ratio.denominator)
