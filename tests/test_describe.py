"""What a compile receives, described as a tree that ``key.Plain`` encodes (cute_diskcache.core.describe).

The hook's key is ``Plain(describer tree)``: marshal writes it in C and refuses every type but the
exact built-ins, so a description that let an enum, a subclass of ``int`` or ``str``, or a DSL
object through would make a whole site unkeyable. These tests hold every branch of the describer
to exact built-ins, and the identity caches to never mixing two objects up.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from typing import Any

import pytest

from cute_diskcache.core.describe import Describer
from cute_diskcache.keys.key import Plain, UnkeyableError

_EXACT = (tuple, str, int, float, bool, type(None), bytes)


def _describe(*values: Any, fingerprinted: Any = None) -> tuple[Any, ...]:
    d = Describer(fingerprinted or (lambda module: module == __name__))
    return tuple(d(v) for v in values)


def _exact_only(tree: Any) -> list[str]:
    """Every node whose type is not an exact built-in (empty: marshal writes it faithfully)."""
    if type(tree) not in _EXACT:
        return [f"{type(tree).__module__}.{type(tree).__qualname__}: {tree!r}"]
    return [bad for item in tree for bad in _exact_only(item)] if type(tree) is tuple else []


class Colour(enum.IntEnum):
    RED = 1


class Size(enum.IntEnum):
    SMALL = 1


class Access(enum.Flag):
    READ = 1
    WRITE = 2


class Count(int):
    pass


class Name(str):
    pass


class Ratio(float):
    pass


class Blob(bytes):
    pass


class Pair(tuple):
    pass


Point = collections.namedtuple("Point", "x y")


@dataclasses.dataclass
class Barrier:
    barrier_id: int
    colour: Colour


class Kernel:
    """A kernel object of a fingerprinted module: keyed by class and state."""

    def __init__(self) -> None:
        self.tile = (128, Count(64))
        self.colour = Colour.RED
        self.dtype = Barrier
        self.barrier = Barrier(1, Colour.RED)
        self.name = Name("silu")
        self.limit = Ratio(1.5)
        self.raw = Blob(b"\x00")
        self.pair = Pair((1, 2))
        self.point = Point(1, Colour.RED)
        self.options = {"b": [1, 2], "a": None}
        self.flags = Access.READ | Access.WRITE


def test_every_branch_gives_only_exact_built_ins_and_plain_encodes_it() -> None:
    tree = _describe(Kernel(), Colour.RED, Count(3), Name("x"), Ratio(0.5), Blob(b"y"), Pair((Count(1),)),
                     Point(Colour.RED, 2), [Count(1)], {"k": Colour.RED}, Barrier(2, Colour.RED), Access.READ)
    assert _exact_only(tree) == []
    Plain(tree)  # raises UnkeyableError on anything else


def test_subclasses_of_plain_types_key_as_their_plain_value() -> None:
    """As the tagged encoding always had it: an ``int`` subclass is its int (never its repr)."""
    described = _describe(Count(3), Name("x"), Ratio(0.5), Blob(b"y"))
    assert described == (3, "x", 0.5, b"y")
    assert [type(v) for v in described] == [int, str, float, bytes]


def test_enum_members_key_by_class_and_name_not_by_the_int_they_equal() -> None:
    red, small, one = _describe(Colour.RED, Size.SMALL, 1)
    assert len({Plain(red).data, Plain(small).data, Plain(one).data}) == 3
    assert red == ("enum", f"{__name__}.Colour", "RED")


def test_flag_combinations_are_told_apart() -> None:
    both, read, write = _describe(Access.READ | Access.WRITE, Access.READ, Access.WRITE)
    assert len({both, read, write}) == 3


def test_sequence_subclasses_are_named_and_never_taken_for_a_tuple() -> None:
    plain, pair, point = _describe((1, 2), Pair((1, 2)), Point(1, 2))
    assert plain == ("tuple", (1, 2))
    assert pair[0] == f"sequence:{__name__}.Pair" and point[0] == f"namedtuple:{__name__}.Point"
    assert type(pair[1]) is tuple and type(point[1]) is tuple


def test_an_object_of_a_module_not_fingerprinted_is_refused() -> None:
    with pytest.raises(UnkeyableError):
        _describe(Kernel(), fingerprinted=lambda module: False)


def test_the_identity_caches_never_mix_up_types_that_compare_equal() -> None:
    """Classes and enum members are described once and remembered by identity: a metaclass whose
    ``__eq__`` says every class is equal (and hashes alike) must still give two descriptions."""

    class Sloppy(type):
        def __eq__(cls, other: object) -> bool:
            return True

        def __hash__(cls) -> int:
            return 0

    class A(metaclass=Sloppy):
        pass

    class B(metaclass=Sloppy):
        pass

    assert _describe(A, B, A) == (("class", f"{__name__}.{A.__qualname__}"), ("class", f"{__name__}.{B.__qualname__}"),
                                  ("class", f"{__name__}.{A.__qualname__}"))


def test_a_description_is_the_same_in_every_describer_and_names_the_modules_it_met() -> None:
    d1, d2 = Describer(lambda module: module == __name__), Describer(lambda module: module == __name__)
    assert d1(Kernel()) == d2(Kernel())
    assert list(d1.modules) == [__name__]
