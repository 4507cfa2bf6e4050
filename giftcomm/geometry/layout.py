"""Buffer layout: the flat gradient buffer as an ordered list of named segments.

A segment is one tensor (a layer's weight gradient, a bias, a norm scale) stored contiguously,
in row-major (C) order, at a fixed element offset of the flat buffer. Segments are packed in the
order given, with no gaps; the buffer has ``sum(prod(shape))`` elements.

Transforms act on a segment's *matrix view*: shape ``(m, n)`` as is; a 1-D shape ``(n,)`` as
``(1, n)``; a scalar as ``(1, 1)``; a shape ``(m, d1, d2, ...)`` as ``(m, d1*d2*...)`` (the first
axis is the output axis, as for a convolution's ``out x in x kh x kw`` weight).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from math import prod

__all__ = ["Segment", "Layout", "as_layout"]


@dataclass(frozen=True)
class Segment:
    """One named tensor of the flat buffer.

    name: unique, non-empty. shape: tuple of non-negative ints. offset: first element (int).
    """

    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def size(self) -> int:
        """Number of elements."""
        return prod(self.shape)

    @property
    def stop(self) -> int:
        """One past the last element's offset."""
        return self.offset + self.size

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def matrix_shape(self) -> tuple[int, int]:
        """(rows m = output dim, cols n = input dim) of the matrix view (see module doc)."""
        if self.ndim == 0:
            return (1, 1)
        if self.ndim == 1:
            return (1, self.shape[0])
        return (self.shape[0], prod(self.shape[1:]))


class Layout:
    """Ordered named segments covering a flat buffer of ``size`` elements.

    ``Layout([("q", (1024, 1024)), ("q.bias", (1024,))])``. Immutable; compare with ``==``.
    """

    __slots__ = ("segments", "size", "_index")

    def __init__(self, segments: Iterable[tuple[str, Sequence[int] | int]]):
        segs: list[Segment] = []
        index: dict[str, int] = {}
        offset = 0
        for item in segments:
            try:
                name, shape = item
            except (TypeError, ValueError):
                raise ValueError(f"a layout entry is a (name, shape) pair, got {item!r}") from None
            if not isinstance(name, str) or not name:
                raise ValueError(f"segment names are non-empty strings, got {name!r}")
            if name in index:
                raise ValueError(f"duplicate segment name {name!r}")
            shape = (shape,) if isinstance(shape, int) else tuple(shape)
            if any(isinstance(d, bool) or int(d) != d or d < 0 for d in shape):
                raise ValueError(f"segment {name!r}: shape must be non-negative ints, got {shape!r}")
            seg = Segment(name, tuple(int(d) for d in shape), offset)
            index[name] = len(segs)
            segs.append(seg)
            offset = seg.stop
        self.segments: tuple[Segment, ...] = tuple(segs)
        self.size: int = offset
        self._index = index

    @classmethod
    def of(cls, arrays: dict) -> Layout:
        """Layout of a name -> array mapping (insertion order), e.g. a model's gradients."""
        return cls((name, tuple(a.shape)) for name, a in arrays.items())

    def __getitem__(self, name: str) -> Segment:
        try:
            return self.segments[self._index[name]]
        except KeyError:
            raise KeyError(f"no segment named {name!r}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def __iter__(self):
        return iter(self.segments)

    def __len__(self) -> int:
        return len(self.segments)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and self.entries() == other.entries()

    def __hash__(self) -> int:
        return hash(self.entries())

    def entries(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """The (name, shape) pairs, in order."""
        return tuple((s.name, s.shape) for s in self.segments)

    def __repr__(self) -> str:
        return f"Layout({list(self.entries())!r})"


def as_layout(layout_or_size) -> Layout:
    """A Layout from a Layout, a list of (name, shape) pairs, or an int (one 1-D segment "flat")."""
    if isinstance(layout_or_size, Layout):
        return layout_or_size
    if isinstance(layout_or_size, (int,)) and not isinstance(layout_or_size, bool):
        if layout_or_size < 0:
            raise ValueError(f"size must be >= 0, got {layout_or_size}")
        return Layout([("flat", (int(layout_or_size),))])
    return Layout(layout_or_size)
