"""The cost of a pickle, measured from its opcodes before anything is unpickled.

A pickle is a program for a small stack machine, and a few hundred bytes of it can describe
a structure that is enormous once expanded: the memo lets one object be used any number of
times (a tuple holding itself twice, 64 levels deep, is 2**64 leaves to hash, compare, print
or convert to JSON), and nesting costs one byte per level (300,000 nested tuples crash the
interpreter when hashed). The unpickler builds such a structure in linear time; what follows
it cannot cope. ``scan`` runs the pickle's opcodes on summaries instead of objects (each
stack entry is the size and depth of what it stands for) and refuses, naming the limit,
a pickle that:

* nests containers or objects deeper than ``MAX_DEPTH``;
* makes more than ``MAX_OBJECTS`` objects, or reads the memo more than ``MAX_OBJECTS`` times;
* expands, every memo reference written out in full, to more than ``MAX_EXPANDED`` values;
* changes a container after it was placed in another one, which is how a pickle describes a
  structure that contains itself (recursive structures have no finite expansion);
* refers to out-of-band buffers, or is malformed (persistent ids are left to the unpickler,
  which refuses them).

One pass over the opcodes (``pickletools.genops``), constant work per opcode: linear in the
pickle's size. Messages quote nothing from the pickle but opcode names and positions.
"""

from __future__ import annotations

import io
import pickletools
from dataclasses import dataclass

from ._strict_json import MAX_DEPTH, MAX_ITEMS

__all__ = ["scan", "PickleRefused", "PickleCost", "MAX_DEPTH", "MAX_OBJECTS", "MAX_EXPANDED"]

MAX_OBJECTS = MAX_ITEMS
"""Most objects a pickle may make, and most memo reads (a DCP metadata of a million chunks makes some 10 million)."""
MAX_EXPANDED = 2 * MAX_ITEMS
"""Most values a pickle may stand for with every shared object written out each time it is used."""


class PickleRefused(ValueError):
    """A pickle passes a limit (or is malformed); the message says which, and at which opcode.

    Attributes:
        malformed: not a pickle at all (truncated, unknown opcodes, a stack that does not add
            up), rather than a pickle past a limit; ``detail`` says what.
    """

    def __init__(self, message: str, *, malformed: bool = False, detail: str = "") -> None:
        super().__init__(message)
        self.malformed, self.detail = malformed, detail


@dataclass(frozen=True, slots=True)
class PickleCost:
    """What a pickle would build: ``objects`` made, ``memo_reads``, ``expanded`` values, ``depth``."""

    objects: int
    memo_reads: int
    expanded: int
    depth: int


class _Node:
    """What one stack entry stands for: its expanded size and depth; ``sealed`` once placed in another."""

    __slots__ = ("depth", "sealed", "size")

    def __init__(self, size: int = 1, depth: int = 0) -> None:
        self.size, self.depth, self.sealed = size, depth, False


_MARK = object()

_SCALARS = frozenset({
    "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "STRING", "BINSTRING", "SHORT_BINSTRING",
    "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8", "UNICODE", "SHORT_BINUNICODE", "BINUNICODE",
    "BINUNICODE8", "NONE", "NEWTRUE", "NEWFALSE", "FLOAT", "BINFLOAT", "GLOBAL", "EXT1", "EXT2", "EXT4",
})
_EMPTY = frozenset({"EMPTY_LIST", "EMPTY_TUPLE", "EMPTY_DICT", "EMPTY_SET"})
_FROM_MARK = frozenset({"LIST", "TUPLE", "DICT", "FROZENSET", "INST", "OBJ"})
_INTO_FROM_MARK = frozenset({"APPENDS", "SETITEMS", "ADDITEMS"})
_PUT = frozenset({"PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"})
_GET = frozenset({"GET", "BINGET", "LONG_BINGET"})
_IGNORED = frozenset({"PROTO", "FRAME", "READONLY_BUFFER"})


def scan(data: bytes, *, what: str) -> PickleCost:
    """Measure pickle ``data`` (``what`` names it in messages); ``PickleRefused`` past any limit.

    Only the first pickle in ``data`` is read (up to its ``STOP``), as ``pickle.loads`` does.
    """
    stack: list[_Node | object] = []
    memo: dict[object, _Node] = {}
    objects = reads = 0

    def refuse(problem: str, pos: int) -> PickleRefused:
        malformed = "malformed" in problem
        return PickleRefused(f"{what}: {problem} (at byte {pos}); refused before unpickling it.",
                             malformed=malformed, detail=f"{problem} at byte {pos}")

    def pop(pos: int, name: str) -> _Node:
        if not stack or stack[-1] is _MARK:
            raise refuse(f"opcode {name} finds no object on the stack (a malformed pickle)", pos)
        node = stack.pop()
        assert isinstance(node, _Node)
        return node

    def pop_mark(pos: int, name: str) -> list[_Node]:
        for k in range(len(stack) - 1, -1, -1):
            if stack[k] is _MARK:
                items = stack[k + 1:]
                del stack[k:]
                return items  # type: ignore[return-value]  # only nodes above the mark
        raise refuse(f"opcode {name} finds no mark on the stack (a malformed pickle)", pos)

    def make(children: list[_Node], pos: int) -> _Node:
        nonlocal objects
        objects += 1
        if objects > MAX_OBJECTS:
            raise refuse(f"it makes more than {MAX_OBJECTS} objects", pos)
        node = _Node()
        add(node, children, pos)
        return node

    def add(node: _Node, children: list[_Node], pos: int) -> None:
        if node.sealed or any(child is node for child in children):
            raise refuse("it changes a container or object after placing it in another, as a pickle of a "
                          "structure that contains itself does (it has no finite expansion)", pos)
        for child in children:
            child.sealed = True
            node.size += child.size
            node.depth = max(node.depth, child.depth + 1)
        if node.depth > MAX_DEPTH:
            raise refuse(f"it nests objects more than {MAX_DEPTH} levels deep", pos)
        if node.size > MAX_EXPANDED:
            raise refuse(f"it stands for more than {MAX_EXPANDED} values once every shared (memoized) object is "
                         f"counted each time it is used", pos)

    stopped = False
    try:
        for opcode, arg, pos in pickletools.genops(io.BytesIO(data)):
            at = pos if pos is not None else -1
            name = opcode.name
            if name in _SCALARS:
                stack.append(make([], at))
            elif name in _EMPTY:
                node = make([], at)
                node.depth = 1
                stack.append(node)
            elif name == "MARK":
                stack.append(_MARK)
            elif name in _FROM_MARK:
                node = make(pop_mark(at, name), at)
                node.depth = max(node.depth, 1)
                stack.append(node)
            elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
                count = int(name[-1])
                items = [pop(at, name) for _ in range(count)][::-1]
                node = make(items, at)
                node.depth = max(node.depth, 1)
                stack.append(node)
            elif name in ("APPEND", "SETITEM"):
                items = [pop(at, name) for _ in range(1 if name == "APPEND" else 2)]
                target = pop(at, name)
                add(target, items, at)
                stack.append(target)
            elif name in _INTO_FROM_MARK:
                items = pop_mark(at, name)
                target = pop(at, name)
                add(target, items, at)
                stack.append(target)
            elif name in ("REDUCE", "NEWOBJ"):
                args, func = pop(at, name), pop(at, name)
                stack.append(make([func, args], at))
            elif name == "NEWOBJ_EX":
                kwargs, args, cls = pop(at, name), pop(at, name), pop(at, name)
                stack.append(make([cls, args, kwargs], at))
            elif name == "STACK_GLOBAL":
                pop(at, name)
                pop(at, name)
                stack.append(make([], at))
            elif name == "BUILD":
                state = pop(at, name)
                target = pop(at, name)
                add(target, [state], at)
                stack.append(target)
            elif name in _PUT:
                if not stack or stack[-1] is _MARK:
                    raise refuse(f"opcode {name} finds nothing to memoize (a malformed pickle)", at)
                memo[len(memo) if name == "MEMOIZE" else arg] = stack[-1]  # type: ignore[assignment]
            elif name in _GET:
                reads += 1
                if reads > MAX_OBJECTS:
                    raise refuse(f"it reads its memo more than {MAX_OBJECTS} times", at)
                if arg not in memo:
                    raise refuse(f"opcode {name} reads memo entry {arg!r}, which was never written (a malformed "
                                 f"pickle)", at)
                stack.append(memo[arg])
            elif name == "POP":
                if stack and stack[-1] is _MARK:
                    stack.pop()
                else:
                    pop(at, name)
            elif name == "POP_MARK":
                pop_mark(at, name)
            elif name == "DUP":
                if not stack or stack[-1] is _MARK:
                    raise refuse("opcode DUP finds no object on the stack (a malformed pickle)", at)
                stack.append(stack[-1])
            elif name == "PERSID":  # the unpickler's persistent_load decides (and refuses)
                stack.append(make([], at))
            elif name == "BINPERSID":
                stack.append(make([pop(at, name)], at))
            elif name == "NEXT_BUFFER":
                raise refuse("it refers to an out-of-band buffer, which this file never holds", at)
            elif name == "STOP":
                stopped = True
            elif name not in _IGNORED:
                raise refuse(f"opcode {name} is not one this reader knows (malformed)", at)
    except PickleRefused:
        raise
    except Exception as exc:  # genops' own errors: truncated or malformed opcodes and arguments
        detail = f"{type(exc).__name__}: {str(exc)[:120]}"
        msg = f"{what}: not a readable pickle ({detail}); refused before unpickling it."
        raise PickleRefused(msg, malformed=True, detail=detail) from None
    if not stopped or len(stack) != 1 or not isinstance(stack[0], _Node):
        detail = "it does not end with one object and STOP"
        msg = f"{what}: not a complete pickle ({detail}); refused."
        raise PickleRefused(msg, malformed=True, detail=detail)
    top = stack[0]
    return PickleCost(objects, reads, top.size, top.depth)
